//! Scraping a `/metrics` page over plain HTTP, and the quick line lookups tests use on the
//! raw text when a full parse ([`crate::exposition`]) would say no more.

use anyhow::{Context, bail};

/// What one scrape returned: the headers tests check and the body.
#[derive(Debug, Clone)]
pub struct Page {
    pub content_type: String,
    /// `Content-Length`, when the server sent one (the nodes and the router always do).
    pub content_length: Option<usize>,
    pub body: String,
}

/// HOST:PORT of a metrics address given as HOST:PORT (a ready line's `metrics_addr`) or as
/// a URL (`http://HOST:PORT/metrics`, as `pdctl up` prints it, or `https://`).
pub fn authority(addr: &str) -> &str {
    let addr = addr.strip_prefix("http://").unwrap_or(addr);
    let addr = addr.strip_prefix("https://").unwrap_or(addr);
    addr.strip_suffix("/metrics").unwrap_or(addr)
}

/// `GET http://{addr}/metrics` (`addr` as [`authority`] reads it); anything but 200 is an
/// error.
pub async fn fetch(addr: &str) -> anyhow::Result<Page> {
    let addr = authority(addr);
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    fetch_over(stream, addr).await
}

/// [`fetch`] over a connection already open to `authority` (HOST:PORT), e.g. a TLS one.
pub async fn fetch_over<S>(stream: S, authority: &str) -> anyhow::Result<Page>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt as _;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let request = hyper::Request::get("/metrics")
        .header(hyper::header::HOST, authority)
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())?;
    let response = sender.send_request(request).await?;
    if !response.status().is_success() {
        bail!("{authority}/metrics answered {}", response.status());
    }
    let header = |name| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let content_type = header(hyper::header::CONTENT_TYPE).unwrap_or_default();
    let content_length = header(hyper::header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
    let body = response.into_body().collect().await?.to_bytes();
    Ok(Page {
        content_type,
        content_length,
        body: String::from_utf8(body.to_vec())?,
    })
}

/// The exposition text of `addr`'s `/metrics` ([`fetch`]'s body).
pub async fn scrape(addr: &str) -> anyhow::Result<String> {
    Ok(fetch(addr).await?.body)
}

/// [`scrape`] from synchronous code (a plain `#[test]`), on a runtime of its own; not for
/// use inside a runtime.
pub fn scrape_blocking(addr: &str) -> anyhow::Result<String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(scrape(addr))
}

/// Whether `line` is a sample of `family` (its name exactly, labelled or not).
fn of_family(line: &str, family: &str) -> bool {
    line.strip_prefix(family)
        .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
}

/// The value of the first series of `family` whose line contains every one of `labels`
/// (written as in the text, e.g. `role="prefill"`).
pub fn value(text: &str, family: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| of_family(l, family))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The sum of `family` over every series whose line contains every one of `labels`.
pub fn sum(text: &str, family: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| of_family(l, family))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no value in {l:?}"))
        })
        .sum()
}

#[test]
fn lookups_match_the_family_exactly() {
    let text = "# TYPE a counter\na{r=\"x\"} 1\na{r=\"y\"} 2\na_total 5\nq 3\n";
    assert_eq!(value(text, "a", &["r=\"y\""]), Some(2.0));
    assert_eq!(value(text, "q", &[]), Some(3.0));
    assert_eq!(value(text, "a", &["r=\"z\""]), None);
    assert_eq!(sum(text, "a", &[]), 3.0);
}
