//! A panic inside an engine command (the test hook `PD_TEST_PANIC_ON_PROMPT`, honoured in
//! builds with debug assertions): the failure observers run before any open request hears of
//! it, every open request (the poison one and an innocent one) fails with
//! `ErrorKind::EnginePanic`, the engine is unhealthy, and later submissions fail with a plain
//! INTERNAL error (they did not meet the panic).
//!
//! Its own test binary: it sets the hook's environment variable before any engine starts,
//! with no other test running in the process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pd_engine::ErrorKind;
use pd_engine::backend::cpu::CpuBackend;
use pd_engine::serve::panic_hook::ENV;
use pd_engine::serve::{Engine, EngineRequest, EngineThread, RequestEvent, Role};
use pd_test_support::engine as support;

const POISON: [u32; 5] = [3, 1, 4, 1, 5];
const WAIT: Duration = Duration::from_secs(60);

fn engine() -> Engine<CpuBackend> {
    support::engine(
        support::executor(CpuBackend::new(), 4, 256),
        support::config(Role::Mixed),
    )
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    support::request(id, prompt, max_tokens, false)
}

/// The request's terminal event (tokens before it skipped).
fn terminal(rx: &std::sync::mpsc::Receiver<RequestEvent>) -> RequestEvent {
    loop {
        let event = rx.recv_timeout(WAIT).expect("a terminal event");
        if event.is_terminal() {
            return event;
        }
    }
}

#[test]
#[cfg_attr(
    not(debug_assertions),
    ignore = "the panic hook is honoured only in builds with debug assertions"
)]
fn a_panic_in_a_command_fails_open_requests_after_the_failure_observers_ran() {
    let poison = POISON.map(|t| t.to_string()).join(",");
    // SAFETY: no other thread of this test binary reads the environment now (one test, and
    // no engine started yet).
    unsafe { std::env::set_var(ENV, poison) };
    let thread = EngineThread::spawn(engine());
    let h = thread.handle();

    let observed = Arc::new(AtomicBool::new(false));
    let unhealthy_when_observed = Arc::new(AtomicBool::new(false));
    {
        let (observed, unhealthy) = (observed.clone(), unhealthy_when_observed.clone());
        let h2 = h.clone();
        h.on_failure(move |what| {
            assert!(what.contains(ENV), "{what}");
            unhealthy.store(!h2.is_healthy(), Ordering::SeqCst);
            // Slow on purpose: no request may hear of the failure before this returns.
            std::thread::sleep(Duration::from_millis(200));
            observed.store(true, Ordering::SeqCst);
        });
    }

    // An innocent request, running when the poison one arrives.
    let innocent = h.submit(req("innocent", (10..30).collect(), 400));
    match innocent.recv_timeout(WAIT).expect("a first event") {
        RequestEvent::Token(_) => {}
        other => panic!("{other:?}"),
    }
    let poisoned = h.submit(req("poison", POISON.to_vec(), 4));

    match terminal(&poisoned) {
        RequestEvent::Failed(e) => {
            assert_eq!(e.kind, ErrorKind::EnginePanic, "{e}");
            assert!(observed.load(Ordering::SeqCst), "failed before NOT_SERVING");
        }
        other => panic!("{other:?}"),
    }
    match terminal(&innocent) {
        RequestEvent::Failed(e) => assert_eq!(e.kind, ErrorKind::EnginePanic, "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(unhealthy_when_observed.load(Ordering::SeqCst));
    assert!(!h.is_healthy());

    // Later work meets a dead engine, not the panic.
    match terminal(&h.submit(req("later", (40..50).collect(), 4))) {
        RequestEvent::Failed(e) => assert_eq!(e.kind, ErrorKind::Internal, "{e}"),
        other => panic!("{other:?}"),
    }
    // An observer that comes late runs at once.
    let late = Arc::new(AtomicBool::new(false));
    let flag = late.clone();
    h.on_failure(move |_| flag.store(true, Ordering::SeqCst));
    assert!(late.load(Ordering::SeqCst));
}
