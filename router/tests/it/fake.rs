//! Scripted, in-process fake prefill and decode nodes (real tonic servers on 127.0.0.1:0),
//! and a harness that runs the real router in front of them.

mod harness;
mod node;
mod state;

pub use harness::*;
pub use node::FakeNode;
pub use state::*;
