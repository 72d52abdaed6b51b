//! The floor of any gRPC router in front of the nodes: a bare `pd.v1.Generation` forwarder,
//! run as its own process like the router, that turns a 1-token `Generate` into one
//! `Prefill` and streams its token back. No validation, tokenizer, routing, metrics,
//! deadlines or abort handling: what remains is the extra gRPC hop itself (two more socket
//! transits, HTTP/2 and protobuf on both sides, the process waking twice). The router's own
//! cost is its figure minus this one, measured in the same rounds.
//!
//! Started by the benchmark re-running its own executable with [`FORWARD_TO`] set; it
//! prints `LISTEN host:port` once it serves.

use std::sync::atomic::{AtomicU64, Ordering};

use pd_proto::pb;
use pd_proto::pb::generation_server::{Generation, GenerationServer};
use pd_proto::pb::prefill_service_client::PrefillServiceClient;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// Set to the prefill node's address, the executable runs as the forwarder.
pub const FORWARD_TO: &str = "PD_BENCH_FORWARD_TO";

struct Forwarder {
    prefill: PrefillServiceClient<Channel>,
    next_id: AtomicU64,
}

#[tonic::async_trait]
impl Generation for Forwarder {
    type GenerateStream = tokio_stream::Once<Result<pb::GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let req = request.into_inner();
        let Some(pb::generate_request::Input::TokenIds(ids)) = req.input else {
            return Err(Status::invalid_argument("the forwarder takes token ids"));
        };
        if req.max_tokens != Some(1) {
            return Err(Status::invalid_argument(
                "the forwarder serves max_tokens 1",
            ));
        }
        let id = format!("fwd-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        // The router's first chunk carries the prompt's length; so does this one, so the two
        // encode the same fields.
        let prompt_tokens = u32::try_from(ids.ids.len()).ok();
        let answer = self
            .prefill
            .clone()
            .prefill(pb::PrefillRequest {
                request_id: id.clone(),
                token_ids: ids.ids,
                sampling: req.sampling,
                cache_salt: req.cache_salt,
                skip_kv_lease: true,
                ..Default::default()
            })
            .await?
            .into_inner();
        let first = answer
            .first_token
            .ok_or_else(|| Status::internal("no first token"))?;
        Ok(Response::new(tokio_stream::once(Ok(
            pb::GenerateResponse {
                request_id: id,
                token_ids: vec![first.token_id],
                prompt_tokens,
                finish_reason: pb::FinishReason::Length as i32,
                usage: answer.usage,
                ..Default::default()
            },
        ))))
    }

    async fn abort(
        &self,
        _: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        Err(Status::unimplemented("bare forwarder"))
    }

    async fn tokenize(
        &self,
        _: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        Err(Status::unimplemented("bare forwarder"))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        Err(Status::unimplemented("bare forwarder"))
    }
}

/// Serve until killed, on one worker thread as the router runs on a 2-core machine
/// (`--worker-threads`: one per four cores), with TCP_NODELAY as the router sets it.
pub fn run(prefill_addr: &str) -> ! {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("forwarder runtime");
    rt.block_on(async {
        let prefill = PrefillServiceClient::connect(format!("http://{prefill_addr}"))
            .await
            .expect("the prefill node");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        println!("LISTEN {}", listener.local_addr().expect("addr"));
        let incoming = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            |conn| {
                conn.inspect(|stream| {
                    let _ = stream.set_nodelay(true);
                })
            },
        );
        tonic::transport::Server::builder()
            .add_service(GenerationServer::new(Forwarder {
                prefill,
                next_id: AtomicU64::new(0),
            }))
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
    std::process::exit(0)
}
