//! Anchors in an expression that is matched whole: `^` / `\A` where every match starts and
//! `$` / `\z` where every match ends say nothing more, and anywhere else they can never hold,
//! so a guide following such an expression would walk into a text it can neither go on with
//! nor end. Regexes and schema patterns are refused for them here, with the reason, instead.
//! Owns that check and the stripping of the harmless ones; not other assertions (`\b`, which
//! automata follow, or multi-line `(?m)^`, which holds after a newline).

use regex_syntax::hir::{Hir, HirKind, Look};

/// `hir` without the `^` (`\A`) that start and the `$` (`\z`) that end its matches: the same
/// whole matches.
pub(super) fn strip_ends(hir: &Hir) -> Hir {
    strip_end(&strip_start(hir))
}

/// The text-start and text-end anchors `hir` holds after [`strip_ends`]: none, or the
/// message saying why it cannot be used.
pub(super) fn inner_anchor(hir: &Hir) -> Option<&'static str> {
    holds_anchor(&strip_ends(hir)).then_some(
        "holds a `^` or `$` (`\\A`, `\\z`) that is not at its start or end, where it can never \
         match: the whole text is matched, so anchors belong only at its ends",
    )
}

fn strip_start(hir: &Hir) -> Hir {
    match hir.kind() {
        HirKind::Look(Look::Start) => Hir::empty(),
        HirKind::Concat(parts) => match parts.split_first() {
            Some((first, rest)) => {
                let mut out = vec![strip_start(first)];
                out.extend(rest.iter().cloned());
                Hir::concat(out)
            }
            None => hir.clone(),
        },
        HirKind::Alternation(members) => {
            Hir::alternation(members.iter().map(strip_start).collect())
        }
        HirKind::Capture(capture) => strip_start(&capture.sub),
        _ => hir.clone(),
    }
}

fn strip_end(hir: &Hir) -> Hir {
    match hir.kind() {
        HirKind::Look(Look::End) => Hir::empty(),
        HirKind::Concat(parts) => match parts.split_last() {
            Some((last, rest)) => {
                let mut out = rest.to_vec();
                out.push(strip_end(last));
                Hir::concat(out)
            }
            None => hir.clone(),
        },
        HirKind::Alternation(members) => Hir::alternation(members.iter().map(strip_end).collect()),
        HirKind::Capture(capture) => strip_end(&capture.sub),
        _ => hir.clone(),
    }
}

fn holds_anchor(hir: &Hir) -> bool {
    match hir.kind() {
        HirKind::Look(look) => matches!(look, Look::Start | Look::End),
        HirKind::Repetition(rep) => holds_anchor(&rep.sub),
        HirKind::Capture(capture) => holds_anchor(&capture.sub),
        HirKind::Concat(parts) | HirKind::Alternation(parts) => parts.iter().any(holds_anchor),
        HirKind::Empty | HirKind::Literal(_) | HirKind::Class(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(re: &str) -> Hir {
        regex_syntax::Parser::new().parse(re).unwrap()
    }

    #[test]
    fn anchors_at_the_ends_of_every_alternative_are_stripped_and_inner_ones_named() {
        for (re, same_as) in [
            ("^ab$", "ab"),
            ("^a|^b", "a|b"),
            ("(^a|b$)c", "(a|b$)c"),
            (r"\Aa\z", "a"),
            ("((^x))", "x"),
        ] {
            assert_eq!(strip_ends(&parse(re)), strip_ends(&parse(same_as)), "{re}");
        }
        for re in ["a^b", "a$b", "(^a|b$)c", "(?:^a)*", "a(b$)?c"] {
            assert!(inner_anchor(&parse(re)).is_some(), "{re}");
        }
        for re in ["^a|^b$", r"\bword\b", "(?m)^a$", "a+"] {
            assert_eq!(inner_anchor(&parse(re)), None, "{re}");
        }
    }
}
