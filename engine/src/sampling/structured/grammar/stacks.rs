//! The grammar's recognizer: a set of parse stacks, as llama.cpp's grammar sampler keeps them.
//! A stack is where the text stands in the rules it is inside: its top is the next byte set to
//! read, each entry below it where to go on once the rule above ends. Reading a byte advances
//! every stack whose top accepts it and expands what follows (a rule's alternatives pushed, an
//! ended rule popped) until every top is a byte set again; the text is whole where some stack
//! emptied.
//!
//! Stacks share their tails, so they are interned lists (a node is a position and the node
//! below it), and a set of stacks is interned too: a state is one `u32`, which the mask cache
//! and the walks of every request hold, and each step from a state by a byte is computed
//! once and kept. A rule called last in an alternative pushes nothing to come back to, so
//! `x*` (`R ::= x R | ε`) keeps the stack as deep as it was. Owns the stacks and their
//! interning; not the grammar (`super`) or the masks (`super::super::trie`).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::{Elem, Grammar};
use crate::sampling::structured::StructuredError;

/// Deepest a stack may grow (rules open inside each other): text nesting deeper is refused,
/// as the JSON grammar refuses JSON nested past its depth.
pub const MAX_GRAMMAR_DEPTH: usize = 256;
/// Most stacks one state may hold (an ambiguous grammar reads one text in many ways at
/// once); a byte that would make more is refused.
pub const MAX_GRAMMAR_STACKS: usize = 1024;
/// Most expansions (a stack entry taken from the work list) one walk may spend on steps not
/// computed before: a mask's walk over the vocabulary, or one token's bytes. An ambiguous
/// grammar can need millions for one byte (its stacks multiply before the stack cap refuses
/// them), so past the budget every step the walk still needs is refused, and kept refused:
/// the grammar's masks are cut short there, the same way each time, instead of holding the
/// engine for seconds. A few milliseconds of one core; the JSON grammar's masks over
/// Qwen3's vocabulary spend up to about 8,000.
pub const MAX_WALK_WORK: usize = 1 << 16;
/// Most nodes and stack entries one grammar interns over its life (tens of bytes each with
/// their maps; sampling eight JSON objects over Qwen3's vocabulary interns about 2,000);
/// past it, bytes that would need new ones are refused.
const MAX_INTERNED: usize = 1 << 20;

/// The node below the bottom of every stack.
const EMPTY: u32 = u32::MAX;

/// A set of stacks: where a text stands in the grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GrammarState(u32);

/// A grammar with its interned stacks, shared by every request that uses it.
pub(crate) struct GrammarGuide {
    grammar: Grammar,
    start: GrammarState,
    stacks: Mutex<Stacks>,
}

impl std::fmt::Debug for GrammarGuide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarGuide")
            .field("elements", &self.grammar.elems.len())
            .finish_non_exhaustive()
    }
}

impl GrammarGuide {
    pub(crate) fn new(grammar: Grammar) -> Result<Self, StructuredError> {
        let mut stacks = Stacks::default();
        stacks.todo.extend(
            grammar.alternatives[grammar.root as usize]
                .iter()
                .map(|&start| (start, EMPTY)),
        );
        let mut budget = MAX_WALK_WORK;
        let start = stacks.settle(&grammar, &mut budget).ok_or_else(|| {
            StructuredError::Grammar("the rule `root` cannot start within the limits".into())
        })?;
        Ok(Self {
            grammar,
            start,
            stacks: Mutex::new(stacks),
        })
    }

    pub(crate) fn start(&self) -> GrammarState {
        self.start
    }

    /// The stacks, locked: a mask's walk steps hundreds of thousands of times, so it locks
    /// once for all of them. The walk may spend [`MAX_WALK_WORK`].
    pub(crate) fn walker(&self) -> Walker<'_> {
        self.walker_with_budget(MAX_WALK_WORK)
    }

    pub(crate) fn walker_with_budget(&self, budget: usize) -> Walker<'_> {
        Walker {
            grammar: &self.grammar,
            stacks: self.stacks.lock().unwrap_or_else(PoisonError::into_inner),
            budget,
        }
    }
}

/// The grammar's stacks, held for a walk.
pub(crate) struct Walker<'a> {
    grammar: &'a Grammar,
    stacks: MutexGuard<'a, Stacks>,
    /// Expansions this walk may still spend.
    budget: usize,
}

impl Walker<'_> {
    /// The state after `byte`, or `None` where the grammar refuses it (or where this walk's
    /// budget ran out before the step was known: refused from then on).
    pub(crate) fn step(&mut self, state: GrammarState, byte: u8) -> Option<GrammarState> {
        self.stacks
            .step(self.grammar, state, byte, &mut self.budget)
    }

    /// Expansions this walk may still spend.
    #[cfg(test)]
    pub(crate) fn budget_left(&self) -> usize {
        self.budget
    }

    /// Whether this walk ran out of budget (some step was refused for it).
    pub(crate) fn exhausted(&self) -> bool {
        self.budget == 0
    }

    /// The text that led to `state` is whole.
    pub(crate) fn is_match(&self, state: GrammarState) -> bool {
        self.stacks.states[state.0 as usize].1
    }
}

#[derive(Debug, Clone, Copy)]
struct Node {
    pos: u32,
    below: u32,
    depth: u32,
}

#[derive(Default)]
struct Stacks {
    nodes: Vec<Node>,
    node_ids: HashMap<(u32, u32), u32>,
    /// Each state's stacks (their top nodes, sorted) and whether some stack emptied.
    states: Vec<(Box<[u32]>, bool)>,
    state_ids: HashMap<(Box<[u32]>, bool), u32>,
    /// Steps computed: (state, byte) → the next state (`EMPTY` where refused).
    next: HashMap<(u32, u8), u32>,
    interned: usize,
    // Scratch of one step: (position, node below) still to expand, those expanded, the tops
    // found.
    todo: Vec<(u32, u32)>,
    seen: HashSet<(u32, u32)>,
    tops: Vec<u32>,
}

impl Stacks {
    fn step(
        &mut self,
        grammar: &Grammar,
        state: GrammarState,
        byte: u8,
        budget: &mut usize,
    ) -> Option<GrammarState> {
        if let Some(&next) = self.next.get(&(state.0, byte)) {
            return (next != EMPTY).then_some(GrammarState(next));
        }
        let stacks = &self.states[state.0 as usize].0;
        for &top in stacks.iter() {
            let node = self.nodes[top as usize];
            if let Elem::Bytes(set) = grammar.elems[node.pos as usize]
                && grammar.sets[usize::from(set)].contains(byte)
            {
                self.todo.push((node.pos + 1, node.below));
            }
        }
        let next = self.settle(grammar, budget);
        if self.interned <= MAX_INTERNED {
            self.next
                .insert((state.0, byte), next.map_or(EMPTY, |s| s.0));
        }
        next
    }

    /// Expands `todo` until every stack's top is a byte set, and interns the set of them
    /// (`None` when there is none and no stack emptied, or past a limit: `budget` spent
    /// included).
    fn settle(&mut self, grammar: &Grammar, budget: &mut usize) -> Option<GrammarState> {
        self.seen.clear();
        self.tops.clear();
        let mut emptied = false;
        while let Some((pos, below)) = self.todo.pop() {
            if *budget == 0 {
                self.todo.clear();
                return None;
            }
            *budget -= 1;
            if !self.seen.insert((pos, below)) {
                continue;
            }
            match grammar.elems[pos as usize] {
                Elem::Bytes(_) => {
                    if let Some(node) = self.node(pos, below) {
                        self.tops.push(node);
                        // Each node is found once (`seen`): past the cap the state is
                        // refused whatever the rest of `todo` holds, so stop expanding it.
                        if self.tops.len() > MAX_GRAMMAR_STACKS {
                            self.todo.clear();
                            return None;
                        }
                    }
                }
                Elem::End if below == EMPTY => emptied = true,
                Elem::End => {
                    let node = self.nodes[below as usize];
                    self.todo.push((node.pos, node.below));
                }
                Elem::Rule(rule) => {
                    // Called last: nothing to come back to but what is below.
                    let back = if grammar.elems[pos as usize + 1] == Elem::End {
                        Some(below)
                    } else {
                        self.node(pos + 1, below)
                    };
                    if let Some(back) = back {
                        self.todo.extend(
                            grammar.alternatives[rule as usize]
                                .iter()
                                .map(|&start| (start, back)),
                        );
                    }
                }
            }
        }
        if self.tops.is_empty() && !emptied {
            return None;
        }
        self.tops.sort_unstable();
        self.tops.dedup();
        if self.tops.len() > MAX_GRAMMAR_STACKS {
            return None;
        }
        let key = (Box::<[u32]>::from(self.tops.as_slice()), emptied);
        if let Some(&id) = self.state_ids.get(&key) {
            return Some(GrammarState(id));
        }
        if self.interned > MAX_INTERNED {
            return None;
        }
        self.interned += key.0.len() + 1;
        let id = self.states.len() as u32;
        self.states.push(key.clone());
        self.state_ids.insert(key, id);
        Some(GrammarState(id))
    }

    /// The node of `pos` above `below`, interned (`None` past [`MAX_GRAMMAR_DEPTH`] or the
    /// interning limit).
    fn node(&mut self, pos: u32, below: u32) -> Option<u32> {
        if let Some(&id) = self.node_ids.get(&(pos, below)) {
            return Some(id);
        }
        let depth = match below {
            EMPTY => 1,
            b => self.nodes[b as usize].depth + 1,
        };
        if depth as usize > MAX_GRAMMAR_DEPTH || self.interned > MAX_INTERNED {
            return None;
        }
        self.interned += 1;
        let id = self.nodes.len() as u32;
        self.nodes.push(Node { pos, below, depth });
        self.node_ids.insert((pos, below), id);
        Some(id)
    }
}
