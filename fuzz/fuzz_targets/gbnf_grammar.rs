//! A GBNF grammar as a request carries it (`grammar` / `guided_grammar`), through its parser
//! and checks (rules defined, `root`, no left recursion, size and depth caps) into the
//! grammar guide over a vocabulary, then walked as the sampler walks it.
//!
//! Properties: nothing panics and nothing runs away (the caps hold on any grammar); a grammar
//! that validates compiles or fails with a typed vocabulary error; a grammar that does not
//! validate fails to compile with the same error; a guide always allows something, and
//! walking from scratch allows what walking token by token allowed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pd_engine::sampling::structured::{StructuredError, StructuredOutput};
use pd_fuzz::{compile, walk};

fuzz_target!(|data: &[u8]| {
    let (grammar, choices) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(grammar) = std::str::from_utf8(grammar) else {
        return;
    };
    let spec = StructuredOutput::Grammar(grammar.to_string());
    assert_eq!(
        spec.regex(),
        Err(StructuredError::NotRegular("a grammar")),
        "a grammar is no regex"
    );
    let validated = spec.validate();
    let compiled = compile(&spec);
    match (&validated, &compiled) {
        (Err(v), Err(c)) => assert_eq!(v, c, "validate and compile refuse alike"),
        (Err(v), Ok(_)) => panic!("compiled a grammar validate refused: {v:?}"),
        (Ok(()), Err(c)) => assert!(
            matches!(
                c,
                StructuredError::Vocabulary(_) | StructuredError::TooComplex(_)
            ),
            "a validated grammar failed to compile with {c:?}"
        ),
        (Ok(()), Ok(_)) => {}
    }
    if let Err(e) = &validated {
        assert!(!e.to_string().is_empty());
    }
    if let Ok(guide) = compiled {
        walk(guide, choices);
    }
});
