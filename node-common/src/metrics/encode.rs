//! The Prometheus text exposition format 0.0.4, written by hand because the exact output has
//! to match vLLM's (Python `prometheus_client`): names with colons, floats written as Go
//! and `prometheus_client` write them (`1.0`, not `1`; `+Inf`; `1e+06` above six integer
//! digits), `le` after the other labels. The Rust crates write `le="1"`; this encoder is
//! small enough to own.

use std::fmt::Write;

use super::histogram::HistogramSnapshot;
use super::names::{Family, label};

/// The `Content-Type` of the output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Labels of one sample, in exposition order.
pub type Labels<'a> = [(&'a str, &'a str)];

/// Writes families one after another.
#[derive(Debug, Default)]
pub struct TextEncoder {
    out: String,
}

impl TextEncoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The `# HELP` and `# TYPE` lines that start a family.
    pub fn header(&mut self, family: Family) {
        let name = family.name();
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(family.help()));
        let _ = writeln!(self.out, "# TYPE {name} {}", family.kind().as_str());
    }

    /// One sample line.
    pub fn sample(&mut self, name: &str, labels: &Labels<'_>, value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        self.out.push(' ');
        self.out.push_str(&go_float(value));
        self.out.push('\n');
    }

    /// The samples of one histogram: cumulative `_bucket`s up to `+Inf`, `_count`, `_sum`
    /// (prometheus_client's order).
    pub fn histogram(&mut self, family: Family, labels: &Labels<'_>, h: &HistogramSnapshot) {
        let name = family.name();
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        let bounds = h
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY));
        for (le, n) in bounds.zip(&h.counts) {
            cumulative += n;
            let le = go_float(le);
            let mut with_le = labels.to_vec();
            with_le.push((label::LE, &le));
            self.sample(&bucket, &with_le, cumulative as f64);
        }
        self.sample(&format!("{name}_count"), labels, cumulative as f64);
        self.sample(&format!("{name}_sum"), labels, h.sum);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// A float as Go and Python's `prometheus_client` (`floatToGoString`) write it: the
/// shortest representation that reads back exactly, `.0` on whole numbers, `+Inf`/`-Inf`/
/// `NaN`, and positive numbers with more than six integer digits as `d.ddde+0N`.
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    let s = python_repr(v);
    if v > 0.0
        && let Some(dot) = s.find('.')
        && dot > 6
    {
        let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
        let mantissa = digits.trim_end_matches(['0', '.']);
        return format!("{mantissa}e+0{}", dot - 1);
    }
    s
}

/// Python's `repr(float)`: Rust's shortest round-trip `Debug` form (same digits, same
/// switch to exponents below 1e-4 and from 1e16), with Python's exponent spelling
/// (`1e-05`, `1e+16`).
fn python_repr(v: f64) -> String {
    let s = format!("{v:?}");
    let Some((mantissa, exp)) = s.split_once('e') else {
        return s;
    };
    let (sign, digits) = match exp.strip_prefix('-') {
        Some(d) => ('-', d),
        None => ('+', exp),
    };
    format!("{mantissa}e{sign}{digits:0>2}")
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_like_prometheus_client() {
        let cases = [
            (1.0, "1.0"),
            (0.0, "0.0"),
            (0.001, "0.001"),
            (0.3, "0.3"),
            (2560.0, "2560.0"),
            (7680.0, "7680.0"),
            (48.0, "48.0"),
            (0.25, "0.25"),
            (999_999.0, "999999.0"),
            (1_000_000.0, "1e+06"),
            (1_234_567.0, "1.234567e+06"),
            (12_345_678_901.0, "1.2345678901e+010"),
            (0.00001, "1e-05"),
            (1e16, "1e+16"),
            (f64::INFINITY, "+Inf"),
            (f64::NEG_INFINITY, "-Inf"),
            (f64::NAN, "NaN"),
        ];
        for (v, want) in cases {
            assert_eq!(go_float(v), want, "{v}");
        }
    }

    #[test]
    fn samples_escape_label_values() {
        let mut e = TextEncoder::new();
        e.sample("x_total", &[("model_name", "a\"b\\c\nd")], 3.0);
        e.sample("y", &[], 0.5);
        assert_eq!(
            e.finish(),
            "x_total{model_name=\"a\\\"b\\\\c\\nd\"} 3.0\ny 0.5\n"
        );
    }

    #[test]
    fn histograms_are_cumulative_with_le_last() {
        let h = HistogramSnapshot {
            bounds: [0.5, 1.0].into(),
            counts: vec![1, 0, 2],
            sum: 7.25,
        };
        let mut e = TextEncoder::new();
        e.header(Family::TimeToFirstToken);
        e.histogram(
            Family::TimeToFirstToken,
            &[("model_name", "m"), ("engine", "0")],
            &h,
        );
        let want = "\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.5\"} 1.0
vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"1.0\"} 1.0
vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"+Inf\"} 3.0
vllm:time_to_first_token_seconds_count{model_name=\"m\",engine=\"0\"} 3.0
vllm:time_to_first_token_seconds_sum{model_name=\"m\",engine=\"0\"} 7.25
";
        assert_eq!(e.finish(), want);
    }
}
