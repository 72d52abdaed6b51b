//! The router's own recorder: one `metrics-exporter-prometheus` recorder per router, its
//! labelled families, and the text exposition (0.0.4) of what it holds.
//!
//! Each [`super::RouterMetrics`] owns its [`Exporter`] and registers its series on it directly
//! (never through the process-global recorder): tests run several routers in one process, and
//! each must export only its own counts. A series is registered once and its handle kept, as
//! the `prometheus` crate's `with_label_values` did; registering creates it at 0.
//!
//! The exporter writes families in hash order with blank lines between them; [`Exporter::render`]
//! sorts families by name and samples within a counter or gauge family, and writes label names
//! in alphabetical order, so the exposition reads as the `prometheus` crate's did.

use std::sync::Arc;

use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Label, Level, Metadata, Recorder, SharedString,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use super::MetricsError;
use super::ids::Family;

/// Where the router's registrations say they come from (the exporter does not render it).
const METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// One router's recorder.
#[derive(Debug)]
pub(crate) struct Exporter {
    recorder: PrometheusRecorder,
}

/// What kind of series a family holds (its `# TYPE`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Exporter {
    /// A recorder whose histograms are `histograms`, each with its bucket upper bounds
    /// (without them the exporter would export summaries).
    pub fn new(histograms: &[(Family, &[f64])]) -> Result<Arc<Self>, MetricsError> {
        let mut builder = PrometheusBuilder::new();
        for (family, buckets) in histograms {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(family.name().to_string()), buckets)?;
        }
        Ok(Arc::new(Self {
            recorder: builder.build_recorder(),
        }))
    }

    /// Gives `family` its help text.
    pub fn describe(&self, family: Family, kind: Kind) {
        let name = KeyName::from_const_str(family.name());
        let help = SharedString::const_str(family.help());
        match kind {
            Kind::Counter => self.recorder.describe_counter(name, None, help),
            Kind::Gauge => self.recorder.describe_gauge(name, None, help),
            Kind::Histogram => self.recorder.describe_histogram(name, None, help),
        }
    }

    pub fn counter(&self, family: Family, names: &[&'static str], values: &[&str]) -> Counter {
        (self.recorder).register_counter(&key(family, names, values), &METADATA)
    }

    pub fn gauge(&self, family: Family, names: &[&'static str], values: &[&str]) -> Gauge {
        (self.recorder).register_gauge(&key(family, names, values), &METADATA)
    }

    pub fn histogram(&self, family: Family, names: &[&'static str], values: &[&str]) -> Histogram {
        (self.recorder).register_histogram(&key(family, names, values), &METADATA)
    }

    /// The exposition of everything registered, with `extra` (whole families the exporter
    /// cannot express, in the text format) among them, families sorted by name.
    pub fn render(&self, extra: &[String]) -> String {
        let text = self.recorder.handle().render();
        let mut families: Vec<(String, String)> = text
            .split("\n\n")
            .chain(extra.iter().map(String::as_str))
            .filter_map(tidy_family)
            .collect();
        families.sort();
        families.into_iter().map(|(_, block)| block).collect()
    }
}

/// The key of one series: label names in alphabetical order (how the text encoder of the
/// `prometheus` crate wrote them).
fn key(family: Family, names: &[&'static str], values: &[&str]) -> Key {
    debug_assert_eq!(names.len(), values.len(), "{}: label values", family.name());
    let mut labels: Vec<Label> = (names.iter().zip(values))
        .map(|(name, value)| Label::new(*name, value.to_string()))
        .collect();
    labels.sort_by(|a, b| a.key().cmp(b.key()));
    Key::from_parts(family.name(), labels)
}

/// One family's block as (name, text ending in a newline), samples of a counter or gauge
/// sorted; `None` for an empty block.
fn tidy_family(block: &str) -> Option<(String, String)> {
    let lines: Vec<&str> = block.lines().filter(|l| !l.is_empty()).collect();
    let (header, mut samples): (Vec<&str>, Vec<&str>) =
        lines.into_iter().partition(|l| l.starts_with('#'));
    let type_line = header.iter().find(|l| l.starts_with("# TYPE "))?;
    let mut words = type_line.split(' ').skip(2);
    let name = words.next()?.to_string();
    // A histogram's or summary's lines of one series go together, in their own order.
    if matches!(words.next(), Some("counter" | "gauge")) {
        samples.sort_unstable();
    }
    let mut out = String::new();
    for line in header.iter().chain(&samples) {
        out.push_str(line);
        out.push('\n');
    }
    Some((name, out))
}

/// A family's label values escaped for the text format (backslash, double quote, newline).
pub(crate) fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A help text escaped for the text format (backslash, newline).
pub(crate) fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Counters of one family, by label values (the `prometheus` crate's `IntCounterVec`).
#[derive(Debug, Clone)]
pub(crate) struct CounterVec {
    exporter: Arc<Exporter>,
    family: Family,
    names: &'static [&'static str],
}

impl CounterVec {
    pub fn new(exporter: &Arc<Exporter>, family: Family, names: &'static [&'static str]) -> Self {
        exporter.describe(family, Kind::Counter);
        Self {
            exporter: exporter.clone(),
            family,
            names,
        }
    }

    /// The series of `values` (in the order of the label names given to [`CounterVec::new`]),
    /// created at 0 the first time.
    pub fn with_label_values(&self, values: &[&str]) -> Counter {
        self.exporter.counter(self.family, self.names, values)
    }

    /// Makes the series of `values` exist (at 0), so rates are defined before its first
    /// count.
    pub fn create(&self, values: &[&str]) {
        let _series = self.with_label_values(values);
    }
}

/// Gauges of one family, by label values (the `prometheus` crate's `GaugeVec`).
#[derive(Debug, Clone)]
pub(crate) struct GaugeVec {
    exporter: Arc<Exporter>,
    family: Family,
    names: &'static [&'static str],
}

impl GaugeVec {
    pub fn new(exporter: &Arc<Exporter>, family: Family, names: &'static [&'static str]) -> Self {
        exporter.describe(family, Kind::Gauge);
        Self {
            exporter: exporter.clone(),
            family,
            names,
        }
    }

    /// See [`CounterVec::with_label_values`].
    pub fn with_label_values(&self, values: &[&str]) -> Gauge {
        self.exporter.gauge(self.family, self.names, values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ids::{TTFT_BUCKETS, label};

    #[test]
    fn families_are_sorted_typed_described_and_labelled_alphabetically() {
        let exporter = Exporter::new(&[(Family::TimeToFirstToken, &TTFT_BUCKETS[..])]).unwrap();
        let requests = CounterVec::new(
            &exporter,
            Family::Requests,
            &[label::OUTCOME, label::MODEL_NAME],
        );
        requests.with_label_values(&["stop", "m"]).increment(2);
        requests.create(&["length", "m"]);
        let up = GaugeVec::new(&exporter, Family::NodeUp, &[label::NODE, label::ROLE]);
        up.with_label_values(&["a:1", "prefill"]).set(1.0);
        exporter.describe(Family::TimeToFirstToken, Kind::Histogram);
        let ttft = exporter.histogram(Family::TimeToFirstToken, &[label::MODEL_NAME], &["m"]);
        ttft.record(0.003);
        let text = exporter.render(&[]);
        let lines: Vec<&str> = text.lines().collect();
        let name = Family::NodeUp.name();
        assert_eq!(lines[0], format!("# HELP {name} {}", Family::NodeUp.help()));
        assert_eq!(lines[1], format!("# TYPE {name} gauge"));
        assert_eq!(
            lines[2],
            format!("{name}{{node=\"a:1\",role=\"prefill\"}} 1")
        );
        let requests = Family::Requests.name();
        assert!(text.contains(&format!(
            "# TYPE {requests} counter\n\
             {requests}{{model_name=\"m\",outcome=\"length\"}} 0\n\
             {requests}{{model_name=\"m\",outcome=\"stop\"}} 2\n"
        )));
        let ttft = Family::TimeToFirstToken.name();
        assert!(text.contains(&format!("# TYPE {ttft} histogram\n")));
        assert!(text.contains(&format!(
            "{ttft}_bucket{{model_name=\"m\",le=\"0.001\"}} 0\n"
        )));
        assert!(text.contains(&format!(
            "{ttft}_bucket{{model_name=\"m\",le=\"0.005\"}} 1\n"
        )));
        assert!(text.contains(&format!(
            "{ttft}_bucket{{model_name=\"m\",le=\"+Inf\"}} 1\n"
        )));
        assert!(text.contains(&format!("{ttft}_count{{model_name=\"m\"}} 1\n")));
        assert!(!text.contains("\n\n"), "{text}");
    }

    #[test]
    fn two_exporters_count_apart() {
        let a = Exporter::new(&[]).unwrap();
        let b = Exporter::new(&[]).unwrap();
        CounterVec::new(&a, Family::Migrations, &[])
            .with_label_values(&[])
            .increment(3);
        CounterVec::new(&b, Family::Migrations, &[]).create(&[]);
        let name = Family::Migrations.name();
        assert!(a.render(&[]).contains(&format!("{name} 3\n")));
        assert!(b.render(&[]).contains(&format!("{name} 0\n")));
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        assert_eq!(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(escape_help("a\\b\nc\"d"), "a\\\\b\\nc\"d");
    }
}
