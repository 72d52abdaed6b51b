//! A cost that grows linearly with an amount of work (prompt tokens to compute, KV bytes to
//! move), learnt online from what the router measures: `seconds ≈ fixed + per_unit × units`,
//! fitted by exponentially weighted least squares so that it follows a node whose speed
//! changes (load, other tenants, a restart on other hardware). Not here: what the units are,
//! or which measurements feed which fit ([`super::costs`]).

/// Weight of the newest sample: about the last 1 / DECAY samples shape the fit.
const DECAY: f64 = 0.1;

/// Below this spread of the samples' units (relative to their mean) the slope is not
/// trusted: every sample had about the same size, so only their mean cost per unit is known.
const MIN_RELATIVE_SPREAD: f64 = 0.05;

/// A linear cost learnt from samples of (units, seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fit {
    /// Weighted sums: weights, units, seconds, units², units × seconds.
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    samples: u64,
}

impl Fit {
    /// Adds one measurement; non-finite or negative values are ignored.
    pub fn add(&mut self, units: f64, seconds: f64) {
        if !(units.is_finite() && seconds.is_finite()) || units < 0.0 || seconds < 0.0 {
            return;
        }
        let keep = if self.samples == 0 { 0.0 } else { 1.0 - DECAY };
        self.w = self.w * keep + 1.0;
        self.x = self.x * keep + units;
        self.y = self.y * keep + seconds;
        self.xx = self.xx * keep + units * units;
        self.xy = self.xy * keep + units * seconds;
        self.samples += 1;
    }

    /// Measurements so far.
    #[cfg(test)]
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// `(fixed seconds, seconds per unit)`, both ≥ 0; `None` before the first sample.
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.samples == 0 {
            return None;
        }
        let mean_x = self.x / self.w;
        let mean_y = self.y / self.w;
        let var = self.xx / self.w - mean_x * mean_x;
        let cov = self.xy / self.w - mean_x * mean_y;
        let spread_ok = mean_x > 0.0 && var.sqrt() > MIN_RELATIVE_SPREAD * mean_x;
        if spread_ok && cov > 0.0 {
            let slope = cov / var;
            let fixed = mean_y - slope * mean_x;
            if fixed >= 0.0 {
                return Some((fixed, slope));
            }
            // The line crosses below zero: keep the slope through the origin instead.
            return Some((0.0, self.xy / self.xx));
        }
        // Samples of one size (or costs that do not grow with it): what a sample costs on
        // average, split evenly between the fixed part and the per-unit part, so a larger
        // request costs more and a smaller one less, and a sample's own size costs its mean.
        if mean_x > 0.0 {
            Some((mean_y / 2.0, mean_y / 2.0 / mean_x))
        } else {
            Some((mean_y, 0.0))
        }
    }

    /// The predicted seconds for `units`; `None` before the first sample.
    pub fn predict(&self, units: f64) -> Option<f64> {
        self.line().map(|(fixed, per)| fixed + per * units.max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unmeasured_fit_predicts_nothing() {
        assert_eq!(Fit::default().predict(10.0), None);
    }

    #[test]
    fn it_learns_a_fixed_cost_and_a_rate() {
        let mut fit = Fit::default();
        for units in [10.0, 200.0, 50.0, 400.0, 120.0, 30.0] {
            fit.add(units, 0.002 + 0.0001 * units);
        }
        let (fixed, per) = fit.line().unwrap();
        assert!((fixed - 0.002).abs() < 1e-9, "{fixed}");
        assert!((per - 0.0001).abs() < 1e-12, "{per}");
        assert!((fit.predict(1000.0).unwrap() - 0.102).abs() < 1e-9);
    }

    #[test]
    fn it_follows_a_node_that_slows_down() {
        let mut fit = Fit::default();
        for units in [10.0, 100.0, 50.0, 200.0] {
            fit.add(units, 0.001 * units);
        }
        let before = fit.predict(100.0).unwrap();
        for _ in 0..10 {
            for units in [10.0, 100.0, 50.0, 200.0] {
                fit.add(units, 0.004 * units);
            }
        }
        let after = fit.predict(100.0).unwrap();
        assert!((before - 0.1).abs() < 1e-9, "{before}");
        assert!(after > 0.35, "{after}");
    }

    #[test]
    fn samples_of_one_size_still_scale_with_the_size_asked() {
        let mut fit = Fit::default();
        for _ in 0..5 {
            fit.add(100.0, 0.2);
        }
        assert!((fit.predict(100.0).unwrap() - 0.2).abs() < 1e-9);
        assert!(fit.predict(10.0).unwrap() < fit.predict(100.0).unwrap());
        assert!(fit.predict(1000.0).unwrap() > fit.predict(100.0).unwrap());
    }

    #[test]
    fn bad_samples_are_ignored() {
        let mut fit = Fit::default();
        fit.add(f64::NAN, 1.0);
        fit.add(1.0, -1.0);
        fit.add(1.0, f64::INFINITY);
        assert_eq!(fit.samples(), 0);
    }

    #[test]
    fn a_line_below_zero_keeps_its_rate_through_the_origin() {
        let mut fit = Fit::default();
        // Cost grows faster than linearly: the least-squares line crosses below zero.
        for units in [1.0, 2.0, 3.0, 100.0] {
            fit.add(units, units * units * 0.001);
        }
        let (fixed, per) = fit.line().unwrap();
        assert_eq!(fixed, 0.0);
        assert!(per > 0.0);
    }
}
