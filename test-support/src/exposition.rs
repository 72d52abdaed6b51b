//! Reading the Prometheus text format 0.0.4 into samples tests can query. Two readings of one
//! grammar: [`Exposition::parse_strict`], for the tests of the exposition itself, refuses
//! what Prometheus would (every sample belongs to the family whose `# TYPE` came last, right
//! after its `# HELP`; names and labels well formed; no series twice; histogram buckets
//! cumulative in increasing `le` order, ending with `+Inf` equal to `_count`), and
//! [`Exposition::parse`], for tests that only read values, keeps every well-formed sample and
//! passes over comments. Names are read as written, `vllm:` colons included.

use std::collections::{BTreeMap, HashSet};

/// One family's declared facts.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyInfo {
    pub help: String,
    pub kind: String,
}

/// Label pairs in exposition order.
pub type LabelSet = Vec<(String, String)>;

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    /// In exposition order.
    pub labels: LabelSet,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One parsed `/metrics` page. Histogram buckets are `NAME_bucket` samples with their `le`
/// label as written; `_sum` and `_count` are samples of their own.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    /// The page as scraped, for failure messages.
    pub text: String,
    /// Declared families (strict parsing only).
    pub families: BTreeMap<String, FamilyInfo>,
    pub samples: Vec<Sample>,
}

fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse().map_err(|_| format!("bad value {s:?}")),
    }
}

/// `{a="x",b="y"}` (the braces stripped) into pairs; escapes `\\`, `\"`, `\n` only.
fn parse_labels(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (name, after) = rest
            .split_once("=\"")
            .ok_or_else(|| format!("label without =\" in {s:?}"))?;
        if !is_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?} in {s:?}")),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => return Err(format!("unterminated label value in {s:?}")),
            }
        };
        if out.iter().any(|(n, _): &(String, String)| n == name) {
            return Err(format!("label {name} twice in {s:?}"));
        }
        out.push((name.to_string(), value));
        rest = &after[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.is_empty() {
            return Err(format!("junk after a label value in {s:?}"));
        }
    }
    Ok(out)
}

/// The family a sample belongs to, given the family's type.
fn family_of(sample: &str, family: &str, kind: &str) -> bool {
    if kind == "histogram" {
        ["_bucket", "_sum", "_count"]
            .iter()
            .any(|suffix| sample.strip_suffix(suffix) == Some(family))
    } else {
        sample == family
    }
}

fn read(text: &str, strict: bool) -> Result<Exposition, String> {
    if strict && !text.ends_with('\n') {
        return Err("the exposition must end with a newline".into());
    }
    let mut exp = Exposition {
        text: text.to_string(),
        ..Exposition::default()
    };
    let mut current: Option<(String, String)> = None;
    let mut pending_help: Option<(String, String)> = None;
    let mut series = HashSet::new();
    for line in text.lines() {
        if !strict {
            if !line.starts_with('#') && !line.trim().is_empty() {
                exp.samples.push(sample(line)?.1);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').ok_or("HELP without text")?;
            if !is_metric_name(name) || exp.families.contains_key(name) {
                return Err(format!("bad or repeated HELP for {name}"));
            }
            pending_help = Some((name.to_string(), help.to_string()));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or("TYPE without a type")?;
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                return Err(format!("unknown type {kind}"));
            }
            let help = match pending_help.take() {
                Some((n, h)) if n == name => h,
                _ => return Err(format!("TYPE of {name} without its HELP just before")),
            };
            if exp.families.contains_key(name) {
                return Err(format!("family {name} declared twice"));
            }
            exp.families.insert(
                name.to_string(),
                FamilyInfo {
                    help,
                    kind: kind.to_string(),
                },
            );
            current = Some((name.to_string(), kind.to_string()));
        } else if line.starts_with('#') || line.is_empty() {
            return Err(format!("unexpected line {line:?}"));
        } else {
            let (series_part, sample) = sample(line)?;
            let name = sample.name.as_str();
            let Some((family, kind)) = &current else {
                return Err(format!("sample {name} before any TYPE"));
            };
            if !family_of(name, family, kind) {
                return Err(format!(
                    "sample {name} is not of the family {family} ({kind})"
                ));
            }
            if !series.insert(series_part.to_string()) {
                return Err(format!("series {series_part} repeated"));
            }
            exp.samples.push(sample);
        }
    }
    exp.check_histograms()?;
    Ok(exp)
}

/// One sample line: its series part as written (name and labels) and the sample.
fn sample(line: &str) -> Result<(&str, Sample), String> {
    let (series_part, value) = line.rsplit_once(' ').ok_or("sample without value")?;
    let (name, labels) = match series_part.split_once('{') {
        Some((name, labels)) => (
            name,
            parse_labels(labels.strip_suffix('}').ok_or("unclosed labels")?)?,
        ),
        None => (series_part, vec![]),
    };
    if !is_metric_name(name) {
        return Err(format!("bad metric name {name:?}"));
    }
    Ok((
        series_part,
        Sample {
            name: name.to_string(),
            labels,
            value: parse_value(value)?,
        },
    ))
}

impl Exposition {
    /// Every well-formed sample of `text`; comments and blank lines pass.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        read(text, false).map_err(anyhow::Error::msg)
    }

    /// `text` read as strictly as Prometheus would (see the module's header).
    pub fn parse_strict(text: &str) -> anyhow::Result<Self> {
        read(text, true).map_err(anyhow::Error::msg)
    }

    fn check_histograms(&self) -> Result<(), String> {
        for (family, info) in &self.families {
            if info.kind != "histogram" {
                continue;
            }
            let bucket = format!("{family}_bucket");
            let mut by_series: BTreeMap<LabelSet, Vec<(f64, f64)>> = BTreeMap::new();
            for s in self.samples.iter().filter(|s| s.name == bucket) {
                let le = s
                    .label("le")
                    .ok_or_else(|| format!("{bucket} without le"))?;
                let rest: Vec<_> = s
                    .labels
                    .iter()
                    .filter(|(k, _)| k != "le")
                    .cloned()
                    .collect();
                by_series
                    .entry(rest)
                    .or_default()
                    .push((parse_value(le)?, s.value));
            }
            for (labels, buckets) in by_series {
                let les: Vec<f64> = buckets.iter().map(|b| b.0).collect();
                if !les.windows(2).all(|w| w[0] < w[1]) || les.last() != Some(&f64::INFINITY) {
                    return Err(format!("{family}: le not increasing to +Inf: {les:?}"));
                }
                if !buckets.windows(2).all(|w| w[0].1 <= w[1].1) {
                    return Err(format!("{family}: buckets not cumulative"));
                }
                let count = self
                    .samples
                    .iter()
                    .find(|s| s.name == format!("{family}_count") && s.labels == labels)
                    .ok_or_else(|| format!("{family}: no _count for {labels:?}"))?;
                if count.value != buckets.last().unwrap().1 {
                    return Err(format!("{family}: +Inf bucket differs from _count"));
                }
            }
        }
        Ok(())
    }

    /// The value of the one sample named `name` whose labels include `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
            .collect();
        assert_eq!(found.len(), 1, "one sample {name} {labels:?}: {found:?}");
        found[0].value
    }

    /// The `le` values of a histogram's buckets, as written.
    pub fn les(&self, family: &str) -> Vec<String> {
        let bucket = format!("{family}_bucket");
        self.samples
            .iter()
            .filter(|s| s.name == bucket)
            .map(|s| s.label("le").unwrap().to_string())
            .collect()
    }

    /// Sum of the samples named `name` whose labels include every `(label, value)` given.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    /// Whether any sample is named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|s| s.name == name)
    }

    /// The distinct values of `label` among the samples named `name`.
    pub fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut values: Vec<String> = self
            .matching(name, &[])
            .filter_map(|s| s.label(label).map(str::to_string))
            .collect();
        values.sort();
        values.dedup();
        values
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> {
        self.samples
            .iter()
            .filter(move |s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
    }
}

#[test]
fn the_strict_reading_refuses_what_prometheus_would() {
    let ok = "# HELP a_total x\n# TYPE a_total counter\na_total{k=\"v\\\"\"} 1.0\n";
    assert!(Exposition::parse_strict(ok).is_ok());
    for bad in [
        "a_total 1.0\n",
        "# HELP a_total x\n# TYPE a_total counter\nb_total 1.0\n",
        "# HELP a_total x\n# TYPE a_total counter\na_total 1.0\na_total 2.0\n",
        "# HELP a_total x\n# TYPE a_total counter\na_total{k=v} 1.0\n",
        "# HELP a_total x\n# TYPE a_total counter\na_total one\n",
        "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"1.0\"} 2.0\nh_bucket{le=\"+Inf\"} 1.0\nh_count 1.0\n",
        "# HELP a_total x\n# TYPE a_total counter\na_total 1.0",
    ] {
        assert!(Exposition::parse_strict(bad).is_err(), "{bad}");
    }
}

#[test]
fn the_lenient_reading_sums_by_label_and_keeps_vllm_names() {
    let text = "# TYPE vllm:x counter\nvllm:x_total{a=\"1\",b=\"2\"} 3\nvllm:x_total{a=\"1\"} 4\n";
    let e = Exposition::parse(text).unwrap();
    assert_eq!(e.sum("vllm:x_total", &[("a", "1")]), 7.0);
    assert_eq!(e.sum("vllm:x_total", &[("b", "2")]), 3.0);
    assert!(e.has("vllm:x_total"));
    assert_eq!(e.label_values("vllm:x_total", "a"), ["1"]);
}
