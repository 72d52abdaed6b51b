//! Taking a request in: every check that refuses it before any block is touched (ids,
//! resumed tokens, the prompt and sampling parameters, the pool's size, the role and
//! imported KV), then its [`Seq`] queued at the back of the waiting line. Scheduling it is
//! `schedule`'s.

use std::time::Instant;

use crate::backend::Backend;
use crate::error::ErrorKind;
use crate::kv::prefix::hash::BlockHasher;
use crate::sampling::{Sampler, StopChecker};
use crate::serve::config::Role;
use crate::serve::prompt::validate_prompt;
use crate::serve::request::{EngineRequest, RequestError};

use super::Engine;
use super::seq::Seq;

fn invalid(message: String) -> RequestError {
    RequestError {
        kind: ErrorKind::InvalidArgument,
        message,
    }
}

impl<B: Backend> Engine<B> {
    /// Queue a request after validating it; an invalid one is refused here, before any
    /// block is touched.
    pub fn submit(&mut self, req: EngineRequest) -> Result<(), RequestError> {
        self.check_request(&req)?;
        self.check_room(&req)?;
        self.check_role(&req)?;
        let seq = self.open_seq(req)?;
        self.waiting.push_back(seq.req.id.clone());
        self.seqs.insert(seq.req.id.clone(), seq);
        Ok(())
    }

    /// The request on its own: a fresh id, resumed tokens, prompt, parameters and guide.
    fn check_request(&self, req: &EngineRequest) -> Result<(), RequestError> {
        if self.seqs.contains_key(&req.id) {
            return Err(invalid(format!("request id {} is already in use", req.id)));
        }
        if req.resumed > 0 && req.resumed >= req.prompt.len() {
            return Err(invalid(format!(
                "a resumed request needs a prompt before its {} resumed tokens; it has {} tokens \
                 in all",
                req.resumed,
                req.prompt.len()
            )));
        }
        if req.resumed > 0 && req.params.prompt_logprobs.is_some() {
            return Err(invalid(
                "a resumed request does not score its prompt again (prompt_logprobs)".into(),
            ));
        }
        let c = self.executor.model().config();
        // Resumed tokens are output: they take their share of max_tokens, not of the prompt.
        validate_prompt(
            &req.prompt,
            c.vocab_size,
            self.config.max_model_len,
            req.params.max_tokens.saturating_sub(req.resumed as u32),
        )
        .map_err(|e| invalid(e.to_string()))?;
        req.params
            .validate(c.vocab_size, self.config.max_model_len as u32)
            .map_err(|e| invalid(e.to_string()))?;
        if req.params.structured_output.is_some() != req.guide.is_some() {
            return Err(invalid(
                "a structured output comes with its compiled guide, and a guide with its \
                 structured output"
                    .into(),
            ));
        }
        Ok(())
    }

    /// A request the whole pool could never hold is refused now rather than left waiting.
    fn check_room(&self, req: &EngineRequest) -> Result<(), RequestError> {
        let need = (req.prompt.len() + req.params.max_tokens as usize)
            .saturating_sub(req.resumed)
            .div_ceil(self.block_size());
        if need > self.num_blocks() {
            return Err(RequestError {
                kind: ErrorKind::ResourceExhausted,
                message: format!(
                    "the request needs {need} KV blocks (prompt {} + max_tokens {}); the whole pool has {}",
                    req.prompt.len(),
                    req.params.max_tokens,
                    self.num_blocks()
                ),
            });
        }
        Ok(())
    }

    /// Imported KV: required on a decode engine, refused on a prefill one, checked where given.
    fn check_role(&self, req: &EngineRequest) -> Result<(), RequestError> {
        match (&req.imported, self.config.role) {
            (None, Role::Decode) => Err(invalid(
                "a decode node serves only requests that bring their prompt's KV".into(),
            )),
            (Some(_), Role::Prefill) => {
                Err(invalid("a prefill node does not take imported KV".into()))
            }
            (Some(imp), _) => self.check_imported(req, imp),
            (None, _) => Ok(()),
        }
    }

    /// The sequence of a checked request: its hashes, sampler and stop state, with resumed
    /// tokens and an imported first token already seen by the stop checks.
    fn open_seq(&self, mut req: EngineRequest) -> Result<Seq, RequestError> {
        let seed = req
            .params
            .effective_seed(self.config.seed ^ xxhash_rust::xxh3::xxh3_64(req.id.0.as_bytes()));
        let mut hasher = BlockHasher::with_algo(
            self.block_size(),
            req.cache_salt.as_deref(),
            self.config.hash_algo,
        );
        hasher.extend(&req.prompt);
        let mut tokens = req.prompt.clone();
        let mut stop = StopChecker::new(&req.params, self.eos_token_ids.clone());
        let output_from = req.prompt.len() - req.resumed;
        for &token in &req.prompt[output_from..] {
            if stop.on_token(token, "").finished.is_some() {
                return Err(invalid(
                    "a resumed token already ends this request: there is nothing to resume".into(),
                ));
            }
        }
        if let Some(imp) = &req.imported {
            // The first token was sampled by the prefill node: it counts towards max_tokens
            // and stop conditions here, but its KV is computed by this node's first step.
            if stop.on_token(imp.first_token, "").finished.is_some() {
                return Err(invalid(
                    "the first token already ends this request: there is nothing to decode".into(),
                ));
            }
            tokens.push(imp.first_token);
            hasher.push(imp.first_token);
        }
        let sampler = Sampler::new(&req.params, seed, &self.eos_token_ids);
        let sampler = match &req.guide {
            Some(guide) => sampler.with_guide(guide.clone()),
            None => sampler,
        };
        Ok(Seq {
            prompt_len: req.prompt.len(),
            output_from,
            sampled_from: tokens.len(),
            tokens,
            hasher,
            blocks: Vec::new(),
            computed: 0,
            registered: 0,
            sampler,
            stop,
            admitted: false,
            imported: req.imported.take(),
            outcome: None,
            prompt_logprobs: req.params.prompt_logprobs.map(|_| Vec::new()),
            arrival: Instant::now(),
            first_scheduled: None,
            first_token: None,
            last_token: None,
            inter_token: Vec::new(),
            req,
        })
    }
}
