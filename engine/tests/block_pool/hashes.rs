//! Block hashes: the incremental `BlockHasher` agrees with one-shot `block_hashes`.

use pd_engine::kv::prefix::hash::{BlockHasher, block_hashes};
use proptest::prelude::*;

proptest! {
    #[test]
    fn incremental_hashes_match_one_shot(
        tokens in prop::collection::vec(any::<u32>(), 0..200),
        chunks in prop::collection::vec(0..20usize, 1..30),
        bs in 1..20usize,
    ) {
        let want = block_hashes(&tokens, bs, None);
        prop_assert_eq!(want.len(), tokens.len() / bs);
        let mut h = BlockHasher::new(bs, None);
        let mut at = 0;
        for c in chunks.iter().cycle() {
            let end = (at + c + 1).min(tokens.len());
            h.extend(&tokens[at..end]);
            prop_assert_eq!(h.hashes(), &block_hashes(&tokens[..end], bs, None)[..]);
            at = end;
            if at == tokens.len() {
                break;
            }
        }
        prop_assert_eq!(h.into_hashes(), want);
    }
}
