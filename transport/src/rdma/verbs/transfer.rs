//! One transfer's READs on a connected queue pair: posted through the bounded window,
//! completions polled until every READ completed, one failed, the deadline passed or the
//! caller gave up; on any of the last three the queue pair is destroyed before this returns,
//! so no READ can write into local memory afterwards.
//!
//! This owns the posting and polling loop and the hand-shake that lets an abandoned caller
//! wait for that destruction ([`StopOnDrop`]). It does not plan READs ([`crate::rdma::plan`],
//! [`crate::rdma::scatter`]) nor own the memory they land in.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdma_mummy_sys::ibv_sge;
use sideway::ibverbs::completion::{PollCompletionQueueError, WorkCompletionStatus};
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};

use super::qp::Connection;
use super::verbs_error;
use crate::rdma::scatter::{ScatterRead, Sge};
use crate::rdma::{RdmaError, ReadWindow};

/// `sges` as rdma-core's scatter-list entries, which sideway's `setup_sge_list` takes.
fn verbs_sges(sges: &[Sge]) -> Vec<ibv_sge> {
    sges.iter()
        .map(|s| ibv_sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

/// Held by a caller whose READs land in memory it only borrows: dropping it (the caller's
/// future was dropped, or the transfer ended) asks the transfer to stop and waits until it
/// has, so the borrow cannot end while a READ may still land.
pub(super) struct StopOnDrop {
    stop: Arc<AtomicBool>,
    stopped: mpsc::Receiver<()>,
}

/// The transfer's side of [`StopOnDrop`]: drop it only once no READ can land any more (done,
/// or the queue pair destroyed).
pub(super) struct StopSignal {
    stop: Arc<AtomicBool>,
    _stopped: mpsc::Sender<()>,
}

impl StopSignal {
    /// A signal nobody raises (the transfer owns the memory its READs land in).
    pub(super) fn never() -> Self {
        stop_pair().1
    }

    fn raised(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

pub(super) fn stop_pair() -> (StopOnDrop, StopSignal) {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    (
        StopOnDrop {
            stop: Arc::clone(&stop),
            stopped: rx,
        },
        StopSignal { stop, _stopped: tx },
    )
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Returns once the signal is dropped: at once if the transfer already ended; else
        // after the transfer's next poll (about 20 us) and the queue pair's destruction.
        // Blocking a runtime thread that briefly is the price of never letting a NIC write
        // into blocks the engine has taken back.
        let _ = self.stopped.recv();
    }
}

/// Run `reads` on `conn`; every entry of every READ must be registered local memory that
/// stays so until this returns. Returns the connection if it is still usable (on an error,
/// a missed deadline or a raised `stop` it is destroyed first, so no READ can land
/// afterwards) and the outcome. Blocking: polls the completion queue until the end.
pub(super) fn transfer(
    mut conn: Connection,
    reads: &[ScatterRead],
    tag: u32,
    max_in_flight: usize,
    deadline: Instant,
    stop: &StopSignal,
) -> (Option<Connection>, Result<(), RdmaError>) {
    let mut window = ReadWindow::new(tag, reads.len(), max_in_flight);
    let mut idle_polls = 0u32;
    let outcome = loop {
        if window.is_done() {
            break Ok(());
        }
        if stop.raised() {
            break Err(RdmaError::Abandoned {
                done: window.completed(),
                total: reads.len(),
            });
        }
        let batch = window.next_batch();
        if !batch.is_empty() {
            let mut post = conn.qp.start_post_send();
            for i in batch.clone() {
                let read = &reads[i];
                let wr = post
                    .construct_wr(window.wr_id(i), WorkRequestFlags::Signaled)
                    .setup_read(read.rkey, read.remote_addr);
                // SAFETY: every entry lies in registered local memory that stays registered
                // and allocated until the READ completed or the queue pair is destroyed (the
                // caller's contract); sideway copies the list before this call returns.
                unsafe { wr.setup_sge_list(&verbs_sges(&read.sges)) };
            }
            if let Err(e) = post.post() {
                break Err(verbs_error("ibv_post_send", e));
            }
            window.posted(batch);
        }
        match conn.cq.start_poll() {
            Ok(poller) => {
                idle_polls = 0;
                let mut failed = None;
                for wc in poller {
                    if wc.status() != WorkCompletionStatus::Success as u32 {
                        let status = WorkCompletionStatus::from(wc.status());
                        failed.get_or_insert(RdmaError::Completion {
                            op: wc.wr_id() as u32,
                            remote_access: status == WorkCompletionStatus::RemoteAccessError,
                            status: format!("{status:?}"),
                        });
                    } else if let Err(e) = window.complete(wc.wr_id()) {
                        failed.get_or_insert(e.into());
                    }
                }
                if let Some(e) = failed {
                    break Err(e);
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => {
                if Instant::now() >= deadline {
                    break Err(RdmaError::Deadline {
                        done: window.completed(),
                        total: reads.len(),
                    });
                }
                // Spin briefly (a READ of a few MiB completes in well under a millisecond),
                // then yield the core.
                idle_polls += 1;
                if idle_polls > 256 {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            Err(e) => break Err(verbs_error("ibv_poll_cq", e)),
        }
    };
    match outcome {
        Ok(()) => (Some(conn), Ok(())),
        Err(e) => {
            // Destroy the queue pair first: after that no READ can write into local memory.
            drop(conn);
            (None, Err(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abandoned_caller_waits_until_the_transfer_lets_go() {
        let (guard, signal) = stop_pair();
        let (seen_tx, seen_rx) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            while !signal.raised() {
                std::thread::yield_now();
            }
            seen_tx.send(()).unwrap();
            // The signal drops here, after the stop was seen.
        });
        drop(guard);
        // Dropping the guard returned, so the worker has seen the stop and let go.
        assert!(seen_rx.try_recv().is_ok());
        worker.join().unwrap();
        let (guard, signal) = stop_pair();
        drop(signal);
        drop(guard); // a finished transfer: no wait
    }
}
