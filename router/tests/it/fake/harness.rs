//! The real router in process in front of fake nodes ([`RouterUnderTest`], [`config`]), and
//! client helpers: channels, polling, the tokenizer, requests and collecting streams.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pd_proto::pb;
use pd_proto::pb::generation_client::GenerationClient;
use pd_router::registry::Registry;
use pd_router::{Router, RouterConfig, RouterError};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Status;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::fake::FakeNode;

/// A router configuration over fake nodes, with fast health checks.
pub fn config(prefill: &[&FakeNode], decode: &[&FakeNode]) -> RouterConfig {
    let mut config = RouterConfig::new(
        "synthetic:tiny",
        prefill.iter().map(|n| n.address()).collect(),
        decode.iter().map(|n| n.address()).collect(),
    );
    config.health_interval = Duration::from_millis(50);
    config.health_timeout = Duration::from_millis(500);
    config.node_timeout = Duration::from_secs(10);
    config
}

/// The real router, in process, on an ephemeral port.
pub struct RouterUnderTest {
    pub addr: SocketAddr,
    /// The OpenAI-compatible HTTP API.
    pub http: SocketAddr,
    /// `/metrics`.
    pub metrics: SocketAddr,
    pub client: GenerationClient<Channel>,
    pub registry: Arc<Registry>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), RouterError>>>,
}

impl RouterUnderTest {
    /// Starts the router and waits until its health is SERVING.
    pub async fn start(config: RouterConfig) -> Self {
        let this = Self::start_unchecked(config).await;
        this.wait_health(ServingStatus::Serving).await;
        this
    }

    /// Starts the router without waiting for any node.
    pub async fn start_unchecked(config: RouterConfig) -> Self {
        let router = tokio::task::spawn_blocking(move || Router::new(config))
            .await
            .unwrap()
            .expect("router starts");
        let registry = router.registry().clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let http_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = http_listener.local_addr().unwrap();
        let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics = metrics_listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(router.serve_with_http(
            listener,
            Some(metrics_listener),
            Some(http_listener),
            async {
                let _ = stopped.await;
            },
        ));
        let client = GenerationClient::connect(format!("http://{addr}"))
            .await
            .expect("connect to the router");
        Self {
            addr,
            http,
            metrics,
            client,
            registry,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// The router's `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        pd_test_support::metrics::scrape(&self.metrics.to_string())
            .await
            .expect("the router's /metrics")
    }

    pub fn client(&self) -> GenerationClient<Channel> {
        self.client.clone()
    }

    pub async fn health(&self) -> ServingStatus {
        let mut health = HealthClient::new(channel(&self.addr.to_string()).await);
        let response = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "pd.v1.Generation".into(),
            })
            .await
            .unwrap();
        response.into_inner().status()
    }

    pub async fn wait_health(&self, want: ServingStatus) {
        for _ in 0..200 {
            if self.health().await == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("router health never became {want:?}");
    }

    /// Graceful shutdown; returns the serve result.
    pub async fn shutdown(mut self) -> Result<(), RouterError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("router drains and stops")
            .unwrap()
    }
}

impl Drop for RouterUnderTest {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A connected channel to `host:port`.
pub async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// Polls `cond` until it holds (5 s at most).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// The built-in Qwen3 tokenizer (the one `synthetic:tiny` uses).
pub fn tokenizer() -> pd_engine::tokenizer::Tokenizer {
    pd_engine::tokenizer::Tokenizer::qwen3().unwrap()
}

pub fn text_request(text: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Text(text.into())),
        max_tokens: Some(64),
        ..Default::default()
    }
}

/// Every chunk of a stream until it ends: `(chunks, Err(status) if it ended with one)`.
pub async fn collect(
    client: &mut GenerationClient<Channel>,
    request: pb::GenerateRequest,
) -> Result<(Vec<pb::GenerateResponse>, Option<Status>), Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut chunks = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => chunks.push(chunk),
            Ok(None) => return Ok((chunks, None)),
            Err(status) => return Ok((chunks, Some(status))),
        }
    }
}

/// A raw HTTP/1.1 completion request for `max_tokens` tokens over a fresh connection: the
/// whole response (head and body) as text.
pub async fn http_completion(addr: SocketAddr, max_tokens: u32) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body = format!(r#"{{"prompt":"hi","max_tokens":{max_tokens}}}"#);
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    String::from_utf8_lossy(&response).into_owned()
}

/// One HTTP/1.1 request over a fresh connection (`Connection: close`): the status and the
/// body as text (chunked bodies are left as sent).
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

pub fn all_text(chunks: &[pb::GenerateResponse]) -> String {
    chunks.iter().map(|c| c.text.as_str()).collect()
}

pub fn all_ids(chunks: &[pb::GenerateResponse]) -> Vec<u32> {
    chunks.iter().flat_map(|c| c.token_ids.clone()).collect()
}
