//! Reading one `<tool_call>` block as it streams: its head (`{"name": "…", "arguments": `,
//! white space anywhere JSON allows it) and then its arguments object, whose text is given out
//! as it arrives. Only the shape Qwen3's template teaches (name first, arguments an object) is
//! streamed; any other block is left to be read whole at its closing tag ([`super`]).
//!
//! Not here: deciding what a block that is not a call becomes (the parser does that).

/// What the start of a block's body says.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Head {
    /// Could still become a streamed call: wait for more text.
    More,
    /// Cannot: the block is read whole.
    No,
    /// A call to `name`; its arguments object starts at byte `args` of the body.
    Call { name: String, args: usize },
}

/// Reads the head of a call's body. The answer for a text is the same whatever text follows
/// it, except `More`, which only more text can turn into `No` or `Call`.
pub(super) fn head(body: &str) -> Head {
    let mut s = Scan { text: body, at: 0 };
    let name = (|| {
        s.literal("{")?;
        s.literal("\"name\"")?;
        s.literal(":")?;
        let name = s.string()?;
        s.literal(",")?;
        s.literal("\"arguments\"")?;
        s.literal(":")?;
        s.white();
        match s.rest().chars().next() {
            None => Err(Head::More),
            Some('{') => Ok(name),
            Some(_) => Err(Head::No),
        }
    })();
    match name {
        Ok(name) => Head::Call { name, args: s.at },
        Err(head) => head,
    }
}

/// A cursor over a body's text; each step fails with `More` when the text ends before it can
/// decide and `No` when it cannot match.
struct Scan<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scan<'a> {
    fn rest(&self) -> &'a str {
        &self.text[self.at..]
    }

    fn white(&mut self) {
        let rest = self.rest();
        self.at += rest.len() - rest.trim_start_matches([' ', '\t', '\n', '\r']).len();
    }

    /// White space, then `token`.
    fn literal(&mut self, token: &str) -> Result<(), Head> {
        self.white();
        let rest = self.rest();
        if rest.starts_with(token) {
            self.at += token.len();
            Ok(())
        } else if token.starts_with(rest) {
            Err(Head::More)
        } else {
            Err(Head::No)
        }
    }

    /// White space, then a JSON string, decoded.
    fn string(&mut self) -> Result<String, Head> {
        self.white();
        let rest = self.rest();
        match rest.chars().next() {
            None => return Err(Head::More),
            Some('"') => {}
            Some(_) => return Err(Head::No),
        }
        let mut escaped = false;
        for (i, c) in rest.char_indices().skip(1) {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => {
                    self.at += i + 1;
                    return serde_json::from_str(&rest[..=i]).map_err(|_| Head::No);
                }
                _ => escaped = false,
            }
        }
        Err(Head::More)
    }
}

/// Where the arguments' text stands: how deep in objects and arrays, inside a string or not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Arguments {
    depth: u32,
    in_string: bool,
    escaped: bool,
}

impl Arguments {
    /// Inside an object already open: the rest of a call's object after its arguments.
    pub(super) fn inside_object() -> Self {
        Self {
            depth: 1,
            ..Self::default()
        }
    }

    /// Whether the next character would be read outside any string.
    pub(super) fn outside_strings(&self) -> bool {
        !self.in_string
    }

    /// Takes one character of the arguments; true when it closed the arguments object.
    pub(super) fn take(&mut self, c: char) -> bool {
        if self.in_string {
            match (self.escaped, c) {
                (false, '\\') => self.escaped = true,
                (false, '"') => self.in_string = false,
                _ => self.escaped = false,
            }
            return false;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: usize) -> Head {
        Head::Call {
            name: name.into(),
            args,
        }
    }

    #[test]
    fn a_head_is_decided_by_its_own_text() {
        let body = "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 1}}";
        let args = body.find("{\"city").unwrap();
        assert_eq!(head(body), call("get_weather", args));
        // Every shorter prefix waits; none decides otherwise.
        for end in (0..=args).filter(|&e| body.is_char_boundary(e)) {
            assert_eq!(head(&body[..end]), Head::More, "{:?}", &body[..end]);
        }
        let body = "{\"name\":\"a\\\"b\",\"arguments\":{}";
        assert_eq!(head(body), call("a\"b", body.len() - 2));
        let body = " { \"name\" : \"\u{e9}\" ,\n\"arguments\" :\t{";
        assert_eq!(head(body), call("\u{e9}", body.len() - 1));
    }

    #[test]
    fn other_shapes_are_not_streamed() {
        for body in [
            "not json",
            "{\"arguments\": {}, \"name\": \"f\"}",
            "{\"name\": \"f\"}",
            "{\"name\": 3, \"arguments\": {}}",
            "{\"name\": \"f\", \"arguments\": null}",
            "{\"name\": \"f\", \"arguments\": [1]}",
            "{\"name\": \"bad \\q escape\", \"arguments\": {}}",
            "[{\"name\": \"f\", \"arguments\": {}}]",
        ] {
            assert_eq!(head(body), Head::No, "{body}");
        }
    }

    #[test]
    fn arguments_end_at_their_own_closing_brace() {
        let text = "{\"a\": [1, {\"b\": \"}]\\\"{\"}], \"c\": \"\\\\\"}";
        let mut args = Arguments::default();
        let ends: Vec<usize> = text
            .char_indices()
            .filter(|&(_, c)| args.take(c))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(ends, [text.len() - 1]);
        assert!(args.outside_strings());
        let mut args = Arguments::default();
        "{\"a\": \"x".chars().for_each(|c| {
            args.take(c);
        });
        assert!(!args.outside_strings());
    }
}
