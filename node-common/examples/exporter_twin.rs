//! A node's `/metrics` output written again by `metrics-exporter-prometheus`: the evidence
//! behind the nodes' encoder choice (docs/metrics.md, "Encoders"; run by
//! `tools/prometheus/encoders.py` from scripts/prometheus-check.sh).
//!
//! Usage: `exporter_twin IN_DIR OUT_DIR`. Every `*.txt` under IN_DIR (one level of
//! subdirectories) is a node's exposition; the same relative path under OUT_DIR receives the
//! same series as the exporter renders them: one recorder per file, every family described
//! with its `# HELP` text, every series registered with the node's name and labels in the
//! node's order, counters set with `absolute`, gauges with `set`, histograms with the node's
//! bucket bounds (`set_buckets_for_metric`) and fed observations that reproduce each
//! bucket's count exactly and the sum up to floating-point rounding (an exporter histogram
//! only takes observations). The output is the recorder's `render()`, untouched.
//!
//! Whatever the exporter cannot express is reported on stderr (`cannot express: ...`) and
//! makes the exit status 2: a counter that is not a whole number, a type other than counter,
//! gauge and histogram, a histogram whose sum no observations in its buckets can give.

use std::collections::BTreeMap;
use std::path::Path;
use std::{env, fs, process};

use metrics::{Key, KeyName, Label, Level, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

const METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// Label names and values, in the order written.
type Labels = Vec<(String, String)>;

/// One parsed family: its type, help text and samples (name, labels, value).
#[derive(Default)]
struct Family {
    kind: String,
    help: String,
    samples: Vec<(String, Labels, f64)>,
}

fn main() {
    let args: Vec<String> = env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: exporter_twin IN_DIR OUT_DIR");
        process::exit(1);
    }
    let (input, output) = (Path::new(&args[1]), Path::new(&args[2]));
    let mut problems = Vec::new();
    let mut files = 0;
    for path in expositions(input) {
        let text = fs::read_to_string(&path).unwrap_or_else(|e| die(&path, e));
        let twin = render(&text, &mut problems);
        let out = output.join(path.strip_prefix(input).expect("under the input"));
        fs::create_dir_all(out.parent().expect("a file")).unwrap_or_else(|e| die(&out, e));
        fs::write(&out, twin).unwrap_or_else(|e| die(&out, e));
        files += 1;
    }
    problems.sort();
    problems.dedup();
    for p in &problems {
        eprintln!("cannot express: {p}");
    }
    println!(
        "exporter_twin: {files} expositions rendered by metrics-exporter-prometheus, {} series it cannot express",
        problems.len()
    );
    if files == 0 || !problems.is_empty() {
        process::exit(2);
    }
}

fn die(path: &Path, e: impl std::fmt::Display) -> ! {
    eprintln!("{}: {e}", path.display());
    process::exit(1);
}

/// `*.txt` files directly in `dir` or in its subdirectories, sorted.
fn expositions(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap_or_else(|e| die(dir, e)).flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(expositions(&path));
        } else if path.extension().is_some_and(|x| x == "txt") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The exporter's rendering of the families in `text`.
fn render(text: &str, problems: &mut Vec<String>) -> String {
    let families = parse(text);
    let mut builder = PrometheusBuilder::new();
    for (name, f) in &families {
        if f.kind == "histogram" {
            let mut bounds: Vec<f64> = f
                .samples
                .iter()
                .filter_map(|(_, labels, _)| labels.iter().find(|(k, _)| k == "le"))
                .map(|(_, le)| number(le))
                .filter(|le| le.is_finite())
                .collect();
            bounds.sort_by(f64::total_cmp);
            bounds.dedup();
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name.clone()), &bounds)
                .expect("bucket bounds");
        }
    }
    let recorder = builder.build_recorder();
    for (name, f) in &families {
        let key_name = KeyName::from(name.clone());
        let help = SharedString::from(f.help.clone());
        match f.kind.as_str() {
            "counter" => {
                recorder.describe_counter(key_name, None, help);
                for (sample, labels, v) in &f.samples {
                    if v.fract() != 0.0 || *v < 0.0 || *v > 2f64.powi(53) {
                        problems.push(format!("counter {sample} = {v} (a u64 in the exporter)"));
                    }
                    recorder
                        .register_counter(&key(sample, labels), &METADATA)
                        .absolute(*v as u64);
                }
            }
            "gauge" => {
                recorder.describe_gauge(key_name, None, help);
                for (sample, labels, v) in &f.samples {
                    recorder
                        .register_gauge(&key(sample, labels), &METADATA)
                        .set(*v);
                }
            }
            "histogram" => {
                recorder.describe_histogram(key_name, None, help);
                for (labels, series) in histogram_series(name, f) {
                    let h = recorder.register_histogram(&key(name, &labels), &METADATA);
                    match observations(&series) {
                        Some(values) => values.iter().for_each(|&v| h.record(v)),
                        None => problems.push(format!(
                            "histogram {name}{labels:?}: sum {} not reachable from its buckets",
                            series.sum
                        )),
                    }
                }
            }
            other => problems.push(format!("{name}: type {other}")),
        }
    }
    recorder.handle().render()
}

fn key(name: &str, labels: &[(String, String)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(k.clone(), v.clone()))
        .collect();
    Key::from_parts(name.to_string(), labels)
}

/// One histogram series: cumulative bucket counts by bound (`+Inf` last), its sum.
struct Series {
    buckets: Vec<(f64, f64)>,
    sum: f64,
}

/// A histogram family's series, keyed by their labels without `le` (in the node's order).
fn histogram_series(name: &str, f: &Family) -> Vec<(Labels, Series)> {
    let mut by_labels: Vec<(Labels, Series)> = Vec::new();
    for (sample, labels, v) in &f.samples {
        let base: Labels = labels.iter().filter(|(k, _)| k != "le").cloned().collect();
        let i = match by_labels.iter().position(|(l, _)| *l == base) {
            Some(i) => i,
            None => {
                by_labels.push((
                    base,
                    Series {
                        buckets: Vec::new(),
                        sum: 0.0,
                    },
                ));
                by_labels.len() - 1
            }
        };
        let series = &mut by_labels[i].1;
        if sample == &format!("{name}_bucket") {
            let le = labels
                .iter()
                .find(|(k, _)| k == "le")
                .expect("a bucket has le");
            series.buckets.push((number(&le.1), *v));
        } else if sample == &format!("{name}_sum") {
            series.sum = *v;
        }
    }
    for (_, s) in &mut by_labels {
        s.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    by_labels
}

/// Observations whose histogram has exactly `series`' bucket counts and (up to rounding)
/// its sum: `n` values in a bucket `(lo, hi]` at `lo + t (hi - lo)`, one `t` in [0, 1] for
/// every finite bucket (the first bucket is `[min(0, bound), bound]`); values beyond the last
/// bound share what is left of the sum. Above the first bucket `t` stays at least 1e-6 so
/// that no value lands on the bound below (a sum within 1e-6 of its least is reproduced a
/// little above it). None when no such values exist.
fn observations(series: &Series) -> Option<Vec<f64>> {
    const T_MIN: f64 = 1e-6;
    let mut buckets = Vec::new();
    let (mut lo, mut below) = (f64::NEG_INFINITY, 0.0);
    for &(le, cumulative) in &series.buckets {
        let n = cumulative - below;
        if n > 0.0 {
            buckets.push((lo, le, n as usize));
        }
        (lo, below) = (le, cumulative);
    }
    // (lo, hi, n, whether lo itself belongs to the bucket).
    let finite: Vec<(f64, f64, usize, bool)> = buckets
        .iter()
        .copied()
        .filter(|b| b.1.is_finite())
        .map(|(lo, hi, n)| match lo.is_finite() {
            true => (lo, hi, n, false),
            false => (hi.min(0.0), hi, n, true),
        })
        .collect();
    let beyond = buckets.iter().find(|b| b.1.is_infinite()).copied();
    let at = |t: f64| -> Vec<f64> {
        finite
            .iter()
            .flat_map(|&(lo, hi, n, closed)| {
                let t = if closed { t } else { t.max(T_MIN) };
                std::iter::repeat_n(lo + t * (hi - lo), n)
            })
            .collect()
    };
    let sum_at = |t: f64| at(t).iter().sum::<f64>();
    match beyond {
        Some((lo, _, n)) => {
            let mut values = at(0.0);
            let each = (series.sum - sum_at(0.0)) / n as f64;
            if each.is_nan() || each <= lo {
                return None;
            }
            values.extend(std::iter::repeat_n(each, n));
            Some(values)
        }
        None => {
            let (low, high) = (sum_at(0.0), sum_at(1.0));
            if finite.is_empty() {
                return (series.sum == 0.0).then(Vec::new);
            }
            let slack = 1e-12 * series.sum.abs().max(1.0);
            if series.sum < low - slack || series.sum > high + slack {
                return None;
            }
            if low >= series.sum {
                return Some(at(0.0));
            }
            // The sum grows with `t` (piecewise linearly): bisect for the one that gives it.
            let (mut below, mut above) = (0.0, 1.0);
            for _ in 0..100 {
                let mid = (below + above) / 2.0;
                if sum_at(mid) < series.sum {
                    below = mid;
                } else {
                    above = mid;
                }
            }
            Some(at(above))
        }
    }
}

/// A sample value or `le` as the text format writes it.
fn number(s: &str) -> f64 {
    match s {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        _ => s.parse().unwrap_or_else(|_| panic!("not a number: {s:?}")),
    }
}

/// The families of a text exposition (0.0.4), keyed by the name on their `# TYPE` line.
fn parse(text: &str) -> BTreeMap<String, Family> {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut current = String::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            families.entry(name.to_string()).or_default().help = unescape(help);
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
            families.entry(name.to_string()).or_default().kind = kind.to_string();
            current = name.to_string();
        } else if !line.starts_with('#') {
            let (sample, labels, value) = sample_line(line);
            families
                .get_mut(&current)
                .unwrap_or_else(|| panic!("sample before any # TYPE: {line}"))
                .samples
                .push((sample, labels, value));
        }
    }
    families
}

/// `name{k="v",...} value` (no timestamp: the nodes write none).
fn sample_line(line: &str) -> (String, Labels, f64) {
    let end = line.find(['{', ' ']).expect("a sample line");
    let name = line[..end].to_string();
    let mut labels = Vec::new();
    let mut rest = &line[end..];
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        let mut close = body.len();
        while let Some(&(i, c)) = chars.peek() {
            if c == '}' {
                close = i;
                break;
            }
            if c == ',' {
                chars.next();
                continue;
            }
            let eq = body[i..].find('=').expect("label=") + i;
            let key = body[i..eq].trim().to_string();
            while chars.next_if(|&(j, _)| j <= eq).is_some() {}
            assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "{line}");
            let mut value = String::new();
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next().map(|(_, c)| c) {
                        Some('n') => value.push('\n'),
                        Some(other) => value.push(other),
                        None => break,
                    },
                    '"' => break,
                    _ => value.push(c),
                }
            }
            labels.push((key, value));
        }
        rest = &body[close + 1..];
    }
    let value = rest.split_whitespace().next().expect("a value");
    (name, labels, number(value))
}

fn unescape(help: &str) -> String {
    let mut out = String::new();
    let mut chars = help.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some(other) => out.push(other),
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}
