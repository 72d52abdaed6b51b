//! TEST-ONLY: make the engine thread panic inside a command, on demand, so that the cluster
//! tests can prove what a real engine panic does (the node turns NOT_SERVING, the request
//! fails with INTERNAL and is not retried on another node).
//!
//! Set `PD_TEST_PANIC_ON_PROMPT=<token ids, comma-separated>` in a node's environment and the
//! engine panics while it takes a request (the `Submit` command, on its thread) whose prompt
//! is exactly those token ids.
//!
//! Why no client can use it: the variable is read once, when the engine thread starts, from
//! the node process's own environment, which only whoever starts the node controls; and it is
//! honoured only in builds with debug assertions (the test builds). A release build never
//! reads it, so a production node cannot be told to panic whatever it is sent or however it
//! is started.

/// The environment variable that arms the hook.
pub const ENV: &str = "PD_TEST_PANIC_ON_PROMPT";

/// The prompt that makes the engine thread panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PanicHook {
    prompt: Vec<u32>,
}

impl PanicHook {
    /// The hook from [`ENV`]; `None` when unset, unparsable (logged) or in a release build.
    pub(crate) fn from_env() -> Option<Self> {
        if !cfg!(debug_assertions) {
            return None;
        }
        let value = std::env::var(ENV).ok()?;
        match Self::parse(&value) {
            Some(hook) => {
                tracing::warn!(
                    "{ENV} is set: this engine panics on the prompt {:?} (a test hook)",
                    hook.prompt
                );
                Some(hook)
            }
            None => {
                tracing::warn!("{ENV}={value:?} is not a list of token ids; ignored");
                None
            }
        }
    }

    fn parse(value: &str) -> Option<Self> {
        let prompt: Option<Vec<u32>> = value.split(',').map(|t| t.trim().parse().ok()).collect();
        prompt
            .filter(|p| !p.is_empty())
            .map(|prompt| Self { prompt })
    }

    /// Panics if `prompt` is the armed one.
    pub(crate) fn check(&self, prompt: &[u32]) {
        if prompt == self.prompt.as_slice() {
            panic!("{ENV}: the test hook's prompt arrived");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_token_ids_and_fires_only_on_the_exact_prompt() {
        let hook = PanicHook::parse(" 5, 6,7 ").unwrap();
        hook.check(&[5, 6]);
        hook.check(&[5, 6, 7, 8]);
        let fired = std::panic::catch_unwind(|| hook.check(&[5, 6, 7]));
        assert!(fired.is_err());
        assert_eq!(PanicHook::parse(""), None);
        assert_eq!(PanicHook::parse("5,x"), None);
    }
}
