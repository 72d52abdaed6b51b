//! How large a guide's automaton may grow: a regex is refused when more than
//! [`MAX_GUIDE_STATES`] states are reachable from its anchored start, before the costly index
//! over the vocabulary is built, and without spending seconds finding out. Owns that count;
//! not the automata the guides then walk.

use regex_automata::Anchored;
use regex_automata::dfa::{Automaton, dense};
use regex_automata::hybrid;
use regex_automata::util::start;

use super::{MAX_GUIDE_STATES, StructuredError};

/// Memory the regex's determinization may use before it is refused (its own cap, before the
/// states are counted).
pub(super) const DFA_BUILD_LIMIT: usize = 32 << 20;
/// Largest DFA built to count its states: room for four times [`MAX_GUIDE_STATES`] states of
/// the widest stride (512 transitions of 4 bytes), so that an expression far past the cap is
/// refused once its DFA outgrows this, not after determinizing 32 MiB of it (seconds of a
/// node's compile thread for some schemas). Built whole, unanchored start included, as the
/// index builds its own: an expression small anchored but huge unanchored (`a[ab]{24}`)
/// would hold the index's build for minutes.
const DFA_SIZE_LIMIT: usize = 4 * MAX_GUIDE_STATES * 512 * 4;

/// Memory the lazy count of anchored states may use: room for far more than the cap's states
/// (a state's transitions take about 1 KiB), so that a clear of its cache means "too many".
const LAZY_CACHE_BYTES: usize = 32 << 20;

/// At most [`MAX_GUIDE_STATES`] states are reachable from the anchored start of `regex`,
/// determinized lazily, state by state, and stopped as soon as the cap is passed: a regex far
/// past the cap is refused in milliseconds, where building its whole DFA first (below) took
/// seconds. False past the cap, when the count would need more memory than allowed, or when
/// the lazy DFA cannot be built (as the whole one then could not be either).
fn anchored_within_cap(regex: &str) -> bool {
    let Ok(dfa) = hybrid::dfa::DFA::builder()
        .configure(
            hybrid::dfa::Config::new()
                .cache_capacity(LAZY_CACHE_BYTES)
                .minimum_cache_clear_count(Some(0)),
        )
        .build(regex)
    else {
        return false;
    };
    let mut cache = dfa.create_cache();
    let Ok(start) = dfa.start_state(&mut cache, &start::Config::new().anchored(Anchored::Yes))
    else {
        return false;
    };
    let mut seen = std::collections::HashSet::from([start]);
    let mut todo = vec![start];
    while let Some(state) = todo.pop() {
        for byte in 0..=255u8 {
            let Ok(next) = dfa.next_state(&mut cache, state, byte) else {
                return false;
            };
            // A cleared cache has forgotten the states counted so far.
            if cache.clear_count() > 0 {
                return false;
            }
            if !next.is_dead() && !next.is_quit() && seen.insert(next) {
                if seen.len() > MAX_GUIDE_STATES {
                    return false;
                }
                todo.push(next);
            }
        }
    }
    true
}

/// Refuses a regex whose automaton has more than [`MAX_GUIDE_STATES`] states (counted over
/// bytes from the anchored start, as the index walks it), before the costly index is built.
pub(super) fn check_states(regex: &str) -> Result<(), StructuredError> {
    let too_complex = || {
        StructuredError::TooComplex(format!(
            "the expression's automaton has more than {MAX_GUIDE_STATES} states (a bounded \
             repetition such as {{20}} of an alternation multiplies them); simplify it"
        ))
    };
    if !anchored_within_cap(regex) {
        return Err(too_complex());
    }
    // Within the cap anchored, the whole DFA (unanchored start included, as the index builds
    // it) must be within its size limit too.
    let dfa = dense::Builder::new()
        .configure(
            dense::Config::new()
                .determinize_size_limit(Some(DFA_BUILD_LIMIT))
                .dfa_size_limit(Some(DFA_SIZE_LIMIT)),
        )
        .build(regex)
        .map_err(|_| too_complex())?;
    let start = dfa
        .universal_start_state(Anchored::Yes)
        .ok_or_else(|| StructuredError::Regex("the expression has no single start".into()))?;
    if !within_state_cap(&dfa, start) {
        return Err(too_complex());
    }
    Ok(())
}

/// At most [`MAX_GUIDE_STATES`] states of `dfa` are reachable from `start` (over all bytes).
pub(super) fn within_state_cap(
    dfa: &regex_automata::dfa::dense::DFA<Vec<u32>>,
    start: regex_automata::util::primitives::StateID,
) -> bool {
    let mut seen = std::collections::HashSet::from([start]);
    let mut todo = vec![start];
    while let Some(state) = todo.pop() {
        for byte in 0..=255u8 {
            let next = dfa.next_state(state, byte);
            if !dfa.is_dead_state(next) && !dfa.is_quit_state(next) && seen.insert(next) {
                if seen.len() > MAX_GUIDE_STATES {
                    return false;
                }
                todo.push(next);
            }
        }
    }
    true
}
