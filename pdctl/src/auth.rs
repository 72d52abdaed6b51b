//! The router's API key on pdctl's client commands (`--api-key KEY`, `PD_API_KEY`): sent as
//! `authorization: Bearer KEY` on every gRPC call (a client interceptor) and HTTP request.
//! A router without `--api-keys` ignores it.

use anyhow::Context as _;
use pd_proto::pb::generation_client::GenerationClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// A channel to the router whose calls carry the API key (if any).
pub type Keyed = InterceptedService<Channel, ApiKey>;

/// The `authorization` value of `--api-key`, or nothing.
#[derive(Clone, Default)]
pub struct ApiKey(Option<MetadataValue<Ascii>>);

/// Never prints the key.
impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ApiKey(set)"
        } else {
            "ApiKey(none)"
        })
    }
}

impl ApiKey {
    pub fn new(key: Option<&str>) -> anyhow::Result<Self> {
        let value = key
            .map(|k| {
                let mut v: MetadataValue<Ascii> = format!("Bearer {k}")
                    .parse()
                    .ok()
                    .context("--api-key must be visible ASCII")?;
                v.set_sensitive(true);
                anyhow::Ok(v)
            })
            .transpose()?;
        Ok(Self(value))
    }

    /// The `Authorization` header value for HTTP requests.
    pub fn header(&self) -> Option<&str> {
        self.0.as_ref().and_then(|v| v.to_str().ok())
    }

    /// A `pd.v1.Generation` client on `channel` whose calls carry the key.
    pub fn client(&self, channel: Channel) -> GenerationClient<Keyed> {
        GenerationClient::with_interceptor(channel, self.clone())
    }
}

impl Interceptor for ApiKey {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}
