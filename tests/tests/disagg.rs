//! `--disagg always|never|auto` end to end (`pdctl up`, real processes): with every setting,
//! each request's output equals `pdctl run`, exactly one decision is counted for it, the node
//! that computed its prompt counted exactly what its usage says (and the other computed
//! nothing for it), the usage's split sums to the prompt, and the router's per-node counters
//! equal the nodes' own. With `auto`, a conversation's next turn, which the decode node
//! mostly holds, is computed there: no prefill node counts a token of it.

use std::path::Path;
use std::time::Duration;

use pd_proto::pb;
use pd_tests::{Cluster, Counts, Exposition, TierHits, collect_as, greedy, reference_tokens};

/// The router's counters keep up with a node's within this long (an Info poll at most).
const SETTLE: Duration = Duration::from_secs(20);
const DECISIONS: &str = "pd_router_disagg_decisions_total";

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|t| (t * 7919 + seed * 104_729 + 11) % 150_000)
        .collect()
}

/// Both nodes' counters once the router's view equals the nodes' own, and the router's page.
async fn settled(cluster: &Cluster) -> ([Counts; 2], Exposition) {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let router = (cluster.exposition(&cluster.router_metrics()).await).expect("router page");
        let mut own = Vec::new();
        let mut agree = true;
        for role in ["prefill", "decode"] {
            let addr = &cluster.nodes(role)[0];
            let page = (cluster.exposition(&cluster.node_metrics(role)[0]).await).expect("node");
            let theirs = (Counts::of_node(&page), TierHits::of_node(&page));
            let seen = (
                Counts::of_router(&router, role, addr),
                TierHits::of_router(&router, role, addr),
            );
            agree &= theirs == seen;
            assert!(
                tokio::time::Instant::now() < deadline,
                "the router's counters of {role} are {seen:?}, the node's {theirs:?}"
            );
            own.push(theirs.0);
        }
        if agree {
            return ([own[0], own[1]], router);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn decisions(page: &Exposition, path: &str) -> f64 {
    page.sum(DECISIONS, &[("path", path)])
}

/// One request, checked; returns its tokens, the path its prompt took and what it added to
/// the decode node's counters.
async fn checked(
    cluster: &Cluster,
    ids: Vec<u32>,
    max_tokens: u32,
) -> (Vec<u32>, &'static str, Counts) {
    let (before, before_page) = settled(cluster).await;
    let mut client = cluster.client().await;
    let (tokens, last) = collect_as(&mut client, greedy(ids.clone(), max_tokens), None)
        .await
        .expect("the request completes");
    let (after, after_page) = settled(cluster).await;
    let usage: pb::Usage = last.usage.expect("usage");
    let local = decisions(&after_page, "local") - decisions(&before_page, "local");
    let remote = decisions(&after_page, "remote") - decisions(&before_page, "remote");
    assert_eq!(local + remote, 1.0, "one decision per request");
    let path = if local == 1.0 { "local" } else { "remote" };

    // The usage's split sums to the prompt.
    let prompt_tokens = ids.len() as u32;
    assert_eq!(usage.prompt_tokens, prompt_tokens);
    assert_eq!(
        usage.cached_tokens,
        usage.local_cached_tokens + usage.external_cached_tokens
    );
    assert_eq!(
        usage.external_host_cached_tokens + usage.external_peer_cached_tokens,
        usage.external_cached_tokens
    );
    assert!(usage.cached_tokens <= prompt_tokens);

    // The node that computed the prompt counted what the usage says; with the local path the
    // prefill node counted nothing at all.
    let prefill = after[0].minus(&before[0]);
    let decode = after[1].minus(&before[1]);
    let computer = match path {
        "local" => {
            assert_eq!(prefill, Counts::default(), "no remote prefill");
            decode
        }
        _ => prefill,
    };
    assert_eq!(computer.prompt_tokens, f64::from(prompt_tokens), "{path}");
    assert_eq!(
        computer.hits,
        f64::from(usage.local_cached_tokens),
        "{path}"
    );
    assert_eq!(
        computer.external_hits,
        f64::from(usage.external_cached_tokens),
        "{path}"
    );
    assert_eq!(
        computer.queries,
        f64::from(prompt_tokens),
        "{path}: the whole prompt looked up"
    );
    (tokens, path, decode)
}

/// The same conversation and requests under `setting`; returns each request's path and what
/// it added to the decode node's counters.
async fn scenario(
    cache: &Path,
    setting: &str,
    reference: &[(Vec<u32>, u32, Vec<u32>)],
) -> (Vec<&'static str>, Vec<Counts>) {
    let cluster = Cluster::up_with_env(
        cache,
        &["--", "--block-size", "16"],
        &[("PD_DISAGG", setting)],
    )
    .expect("cluster up");
    let (mut paths, mut decode) = (Vec::new(), Vec::new());
    for (ids, max_tokens, want) in reference {
        let (tokens, path, counts) = checked(&cluster, ids.clone(), *max_tokens).await;
        assert_eq!(&tokens, want, "{setting}: the output equals pdctl run's");
        paths.push(path);
        decode.push(counts);
    }
    (paths, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_disagg_setting_counts_exactly_and_matches_pdctl_run() {
    let cache = tempfile::tempdir().unwrap();
    // Warm-up prompts of several lengths (what auto measures), a first turn, the next turn
    // (the first turn's prompt and answer and a few new tokens), a one-token request, and
    // the first turn again.
    let first = prompt(1, 200);
    let first_out = reference_tokens(cache.path(), &first, 24);
    let mut second = [first.clone(), first_out.clone()].concat();
    second.extend(prompt(2, 10));
    let mut requests: Vec<(Vec<u32>, u32)> = vec![
        (prompt(10, 40), 4),
        (prompt(11, 120), 4),
        (prompt(12, 250), 4),
        (prompt(13, 70), 4),
        (first.clone(), 24),
        (second, 6),
        (prompt(3, 33), 1),
        (first, 4),
    ];
    let reference: Vec<(Vec<u32>, u32, Vec<u32>)> = requests
        .drain(..)
        .map(|(ids, n)| {
            let want = reference_tokens(cache.path(), &ids, n);
            (ids, n, want)
        })
        .collect();

    let (always, decode) = scenario(cache.path(), "always", &reference).await;
    assert!(always.iter().all(|p| *p == "remote"), "{always:?}");
    // The next turn on the decode node holding the first: it finds the first turn's blocks
    // (at least its prompt's 12 full blocks) and pulls only the rest.
    let next = decode[5];
    let next_len = reference[5].0.len() as f64;
    assert!(next.hits >= 192.0, "{next:?}");
    assert_eq!(next.hits + next.external_hits, next_len, "{next:?}");
    let (never, _) = scenario(cache.path(), "never", &reference).await;
    assert!(never.iter().all(|p| *p == "local"), "{never:?}");
    let (auto, _) = scenario(cache.path(), "auto", &reference).await;
    assert_eq!(auto[0], "remote", "nothing measured yet: {auto:?}");
    assert_eq!(
        auto[5], "local",
        "the next turn, which the decode node holds but for its new tokens: {auto:?}"
    );
}
