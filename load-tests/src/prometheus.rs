//! Reading mlscope-proxy's counters from its admin `/metrics` (Prometheus text exposition).

use std::time::Duration;

/// The exposition at `<admin_url>/metrics`; `None` when it cannot be read.
pub(crate) async fn scrape(client: &reqwest::Client, admin_url: &str) -> Option<String> {
    let response = client
        .get(format!("{admin_url}/metrics"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok()
}

/// The sum of every sample whose series starts with `series` (a metric name with the opening of
/// its label set, e.g. `mlscope_node_samples_total{reason="kept"}` or `mlscope_x_total{`).
pub(crate) fn sum(exposition: &str, series: &str) -> f64 {
    exposition
        .lines()
        .filter(|line| line.starts_with(series))
        .filter_map(|line| line.rsplit_once(' '))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_over_the_series_that_match() {
        let text = "# TYPE mlscope_a counter\n\
                    mlscope_a_total{x=\"1\"} 2\n\
                    mlscope_a_total{x=\"2\"} 3.5\n\
                    mlscope_ab_total 100\n\
                    mlscope_b_sum 7\n";
        assert_eq!(sum(text, "mlscope_a_total{"), 5.5);
        assert_eq!(sum(text, "mlscope_a_total{x=\"2\"}"), 3.5);
        assert_eq!(sum(text, "mlscope_b_sum"), 7.0);
        assert_eq!(sum(text, "mlscope_c"), 0.0);
    }
}
