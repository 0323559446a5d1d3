//! A run's report as one self-contained HTML page: inline CSS and SVG charts, no script and
//! nothing fetched, so MLflow's artifact viewer shows it as it is. Everything a sender named
//! (nodes, pods, outcomes, data changes) is escaped.

use std::fmt::Write as _;

use super::model::{self, Point, RankReport, RunReport};

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
/// Ranks drawn as their own line; the others are summarised in the tables only.
const MAX_LINES: usize = 16;

pub fn html(report: &RunReport) -> String {
    let mut page = String::with_capacity(32 << 10);
    let title = format!(
        "Run report: {}",
        report.run_name.as_deref().unwrap_or(&report.run_id)
    );
    let _ = write!(
        page,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{}</style></head><body>",
        esc(&title),
        STYLE
    );
    let _ = write!(page, "<h1>{}</h1>", esc(&title));
    let _ = write!(
        page,
        "<p class=\"summary\">{}</p><p class=\"meta\">run <code>{}</code> · {} · started {} · {} · report {} by mlscope</p>",
        esc(&report.summary),
        esc(&report.run_id),
        esc(report.status.as_deref().unwrap_or("status unknown")),
        esc(report.start.as_deref().unwrap_or("unknown")),
        match (report.live, report.wall_seconds) {
            (true, Some(s)) => format!("running for {}", model::duration(s)),
            (false, Some(s)) => format!("wall time {}", model::duration(s)),
            _ => "wall time unknown".into(),
        },
        esc(&report.generated),
    );
    if let Some(outcome) = &report.outcome {
        let _ = write!(
            page,
            "<p class=\"outcome\"><b>{}</b>{}</p>",
            esc(outcome),
            report
                .outcome_detail
                .as_deref()
                .map(|d| format!(": {}", esc(d)))
                .unwrap_or_default()
        );
    }
    page.push_str("<h2>Advice</h2>");
    if report.advice.is_empty() {
        page.push_str("<p>Nothing to change: no limit was oversized or nearly reached, no CPU throttling, no idle GPUs beyond the thresholds.</p>");
    } else {
        page.push_str("<ul class=\"advice\">");
        for line in &report.advice {
            let _ = write!(page, "<li>{}</li>", esc(line));
        }
        page.push_str("</ul>");
    }
    charts(&mut page, report);
    ranks_table(&mut page, report);
    if !report.data_changes.is_empty() {
        page.push_str("<h2>Data that changed under the run</h2><ul>");
        for c in &report.data_changes {
            let _ = write!(
                page,
                "<li><b>{}</b> (rank {}, {}): {}</li>",
                esc(&c.name),
                c.rank,
                esc(&c.heard_at),
                esc(&c.what)
            );
        }
        page.push_str("</ul>");
    }
    page.push_str("<h2>How to read this</h2><p class=\"meta\">");
    page.push_str(&esc(&format!(
        "Memory is the container's working set (what the kernel counts against its limit), as the collector measured it; p95 is read from a histogram 2 % fine. CPU is the share of the container's CPU limit used. GPU activity is SM activity where the GPU measures it (GPM), utilization otherwise. Advice thresholds: a memory limit is oversized when the peak plus {:.0} % fits in {:.0} % of it; {:.0} % of the limit is close to an OOM kill; CPU throttled in {:.0} % of periods or more; GPUs idle {:.0} % of the time or more; a rank below {:.0} % of the ranks' median GPU activity is the odd one out.",
        model::MEMORY_HEADROOM * 100.0,
        model::OVERSIZED * 100.0,
        model::NEAR_LIMIT * 100.0,
        model::THROTTLED,
        model::GPU_IDLE_SHARE * 100.0,
        model::STRAGGLER * 100.0,
    )));
    if report.unidentified_writers > 0 {
        let _ = write!(
            page,
            " {} sender(s) of system metrics named no rank (MLflow's own system-metrics monitor, for one): they are not counted as ranks.",
            report.unidentified_writers
        );
    }
    page.push_str("</p></body></html>");
    page
}

fn charts(page: &mut String, report: &RunReport) {
    let drawn: Vec<&RankReport> = report.ranks.iter().take(MAX_LINES).collect();
    let memory: Vec<Line> = drawn
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.charts.memory.is_empty())
        .map(|(i, r)| Line::of(r, i, &r.charts.memory, |p| p.peak))
        .collect();
    if !memory.is_empty() {
        let mut limits: Vec<f64> = drawn
            .iter()
            .filter_map(|r| r.memory.as_ref()?.limit_mb)
            .collect();
        limits.sort_by(f64::total_cmp);
        limits.dedup();
        let marks: Vec<Mark> = drawn
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                let at = r.oom_at_ms?;
                let y = r
                    .memory
                    .as_ref()
                    .map_or(0.0, |m| m.limit_mb.unwrap_or(m.peak_mb));
                Some(Mark {
                    at,
                    y,
                    color: COLORS[i % COLORS.len()],
                    label: format!("rank {} OOM-killed", r.rank),
                })
            })
            .collect();
        page.push_str("<h2>Memory working set against the limit</h2>");
        chart(page, report, &memory, &limits, &marks, ChartUnit::Megabytes);
    }
    let gpu: Vec<Line> = drawn
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.charts.gpu.is_empty())
        .map(|(i, r)| Line::of(r, i, &r.charts.gpu, |p| p.mean))
        .collect();
    if !gpu.is_empty() {
        page.push_str("<h2>GPU activity per rank</h2>");
        chart(page, report, &gpu, &[], &[], ChartUnit::Percent);
    }
    let cpu: Vec<Line> = drawn
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.charts.cpu.is_empty())
        .map(|(i, r)| Line::of(r, i, &r.charts.cpu, |p| p.mean))
        .collect();
    if !cpu.is_empty() {
        page.push_str(
            "<h2>CPU used, share of the limit (of the CPUs it may run on, without one)</h2>",
        );
        chart(page, report, &cpu, &[], &[], ChartUnit::Percent);
    }
    if report.ranks.len() > MAX_LINES {
        let _ = write!(
            page,
            "<p class=\"meta\">The charts draw the first {MAX_LINES} of {} ranks; the table lists all.</p>",
            report.ranks.len()
        );
    }
}

struct Line {
    label: String,
    color: &'static str,
    points: Vec<(i64, f64)>,
}

impl Line {
    fn of(r: &RankReport, i: usize, points: &[Point], value: fn(&Point) -> f64) -> Line {
        Line {
            label: format!("rank {}", r.rank),
            color: COLORS[i % COLORS.len()],
            points: points.iter().map(|p| (p.t_ms, value(p))).collect(),
        }
    }
}

struct Mark {
    at: i64,
    y: f64,
    color: &'static str,
    label: String,
}

#[derive(Clone, Copy)]
enum ChartUnit {
    Megabytes,
    Percent,
}

impl ChartUnit {
    fn label(self, y: f64) -> String {
        match self {
            ChartUnit::Megabytes => model::size(y),
            ChartUnit::Percent => format!("{y:.0} %"),
        }
    }
}

fn chart(
    page: &mut String,
    report: &RunReport,
    lines: &[Line],
    limits: &[f64],
    marks: &[Mark],
    unit: ChartUnit,
) {
    const W: f64 = 900.0;
    const H: f64 = 260.0;
    const LEFT: f64 = 80.0;
    const RIGHT: f64 = 20.0;
    const TOP: f64 = 15.0;
    const BOTTOM: f64 = 35.0;
    let origin = report.chart_origin_ms;
    let xs = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .chain(marks.iter().map(|m| m.at));
    let (mut x0, mut x1) = (i64::MAX, i64::MIN);
    for x in xs {
        x0 = x0.min(x);
        x1 = x1.max(x);
    }
    x0 = x0.min(origin);
    if x1 <= x0 {
        x1 = x0 + 1_000;
    }
    let y_max = match unit {
        ChartUnit::Percent => 100.0,
        ChartUnit::Megabytes => {
            lines
                .iter()
                .flat_map(|l| l.points.iter().map(|p| p.1))
                .chain(limits.iter().copied())
                .fold(1.0, f64::max)
                * 1.08
        }
    };
    let px = |t: i64| LEFT + (t - x0) as f64 / (x1 - x0) as f64 * (W - LEFT - RIGHT);
    let py = |y: f64| TOP + (1.0 - (y / y_max).clamp(0.0, 1.0)) * (H - TOP - BOTTOM);
    let _ = write!(
        page,
        "<svg viewBox=\"0 0 {W} {H}\" width=\"100%\" style=\"max-width:{W}px\" role=\"img\" xmlns=\"http://www.w3.org/2000/svg\" font-family=\"sans-serif\" font-size=\"11\">"
    );
    for i in 0..=4 {
        let y = y_max * f64::from(i) / 4.0;
        let _ = write!(
            page,
            "<line x1=\"{LEFT}\" x2=\"{x2}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{tx}\" y=\"{ty:.1}\" text-anchor=\"end\">{label}</text>",
            x2 = W - RIGHT,
            y = py(y),
            tx = LEFT - 6.0,
            ty = py(y) + 4.0,
            label = esc(&unit.label(y))
        );
    }
    for i in 0..=5 {
        let t = x0 + (x1 - x0) * i / 5;
        let anchor = if i == 5 { "end" } else { "middle" };
        let _ = write!(
            page,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"{anchor}\">{}</text>",
            px(t),
            H - BOTTOM + 16.0,
            esc(&model::since(report, t))
        );
    }
    for limit in limits {
        let _ = write!(
            page,
            "<line x1=\"{LEFT}\" x2=\"{x2}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#000\" stroke-dasharray=\"6 4\"/><text x=\"{tx}\" y=\"{ty:.1}\" text-anchor=\"end\">limit {label}</text>",
            x2 = W - RIGHT,
            y = py(*limit),
            tx = W - RIGHT - 4.0,
            ty = py(*limit) - 4.0,
            label = esc(&model::size(*limit))
        );
    }
    for line in lines {
        let points: Vec<String> = line
            .points
            .iter()
            .map(|&(t, y)| format!("{:.1},{:.1}", px(t), py(y)))
            .collect();
        let _ = write!(
            page,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"><title>{}</title></polyline>",
            line.color,
            points.join(" "),
            esc(&line.label)
        );
    }
    for mark in marks {
        let (x, y) = (px(mark.at), py(mark.y));
        let _ = write!(
            page,
            "<path d=\"M{:.1},{:.1}l12,12m0,-12l-12,12\" stroke=\"{}\" stroke-width=\"3\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"{}\">{}</text>",
            x - 6.0,
            y - 6.0,
            mark.color,
            x - 10.0,
            y + 18.0,
            mark.color,
            esc(&mark.label)
        );
    }
    page.push_str("</svg><div class=\"legend\">");
    for line in lines {
        let _ = write!(
            page,
            "<span><i style=\"background:{}\"></i>{}</span>",
            line.color,
            esc(&line.label)
        );
    }
    page.push_str("</div>");
}

fn ranks_table(page: &mut String, report: &RunReport) {
    if report.ranks.is_empty() {
        page.push_str("<p>No rank of this run sent system metrics with its identity.</p>");
        return;
    }
    page.push_str("<h2>Ranks</h2><table><tr><th>rank</th><th>node · pod</th><th>wall</th><th>memory peak</th><th>p95</th><th>limit</th><th>peak at</th><th>CPU used</th><th>throttled</th><th>GPU activity</th><th>GPU-hours idle</th><th>ended</th></tr>");
    for r in &report.ranks {
        let m = r.memory.as_ref();
        let c = r.cpu.as_ref();
        let g = r.gpu.as_ref();
        let placement = {
            let mut s = esc(if r.node.is_empty() { "?" } else { &r.node });
            if let Some(pod) = &r.pod {
                let _ = write!(s, " · {}", esc(pod));
            }
            if !r.co_located.is_empty() {
                let others: Vec<String> = r.co_located.iter().map(i64::to_string).collect();
                let _ = write!(s, "<br><small>with rank {}</small>", others.join(", "));
            }
            s
        };
        let peak = m.map_or("–".into(), |m| {
            format!(
                "{}{}",
                model::size(m.peak_mb),
                m.peak_fraction
                    .map(|f| format!(" ({:.0} %)", f * 100.0))
                    .unwrap_or_default()
            )
        });
        let at = m.map_or("–".into(), |m| {
            format!(
                "{}{}",
                model::since(report, m.peak_ms),
                m.peak_step
                    .map(|s| format!(", step {s}"))
                    .unwrap_or_default()
            )
        });
        let ended = match (&r.outcome, r.exit_code) {
            (Some(o), Some(code)) => format!("{} (exit {code})", esc(o)),
            (Some(o), None) => esc(o),
            (None, _) => "–".into(),
        };
        let _ = write!(
            page,
            "<tr><td>{}</td><td>{placement}</td><td>{}</td><td>{peak}</td><td>{}</td><td>{}</td><td>{at}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{ended}</td></tr>",
            r.rank,
            r.wall_seconds.map_or("–".into(), model::duration),
            m.and_then(|m| m.p95_mb).map_or("–".into(), model::size),
            m.and_then(|m| m.limit_mb).map_or("none".into(), model::size),
            c.map_or("–".into(), |c| format!(
                "{:.0} % of {}",
                c.mean_percent,
                c.limit_cores.map_or("the node".into(), |l| format!("{l} cores"))
            )),
            c.and_then(|c| c.throttled_percent)
                .map_or("–".into(), |t| format!("{t:.0} %")),
            g.map_or("–".into(), |g| format!(
                "{} × {}: {}",
                g.gpus,
                esc(g.model.as_deref().unwrap_or("GPU")),
                g.activity_mean_percent
                    .map_or("no samples".into(), |a| format!("{a:.0} % ({})", g.measure))
            )),
            g.map_or("–".into(), |g| format!("{:.2} of {:.2}", g.idle_hours, g.gpu_hours)),
        );
    }
    page.push_str("</table>");
    // A rank that left nothing running (`0`) is not worth a line.
    let leftovers: Vec<&RankReport> = report
        .ranks
        .iter()
        .filter(|r| {
            r.leftovers.as_ref().is_some_and(|l| {
                l.processes.as_deref().is_some_and(|p| p != "0") || !l.gpu_memory_left.is_empty()
            })
        })
        .collect();
    if !leftovers.is_empty() {
        page.push_str("<h2>Left running when ranks exited</h2><ul>");
        for r in leftovers {
            let l = r.leftovers.as_ref().map(|l| {
                format!(
                    "{}{}",
                    l.processes.as_deref().unwrap_or("processes unknown"),
                    l.ended
                        .as_deref()
                        .map(|e| format!("; {e}"))
                        .unwrap_or_default()
                )
            });
            let _ = write!(
                page,
                "<li>rank {}: {}</li>",
                r.rank,
                esc(&l.unwrap_or_default())
            );
        }
        page.push_str("</ul>");
    }
}

/// `text` safe in HTML text and attribute values.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:-apple-system,'Segoe UI',Roboto,sans-serif;margin:24px;color:#222;max-width:1100px}\
h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:24px 0 8px;border-bottom:1px solid #eee;padding-bottom:4px}\
.summary{font-size:16px;background:#f4f7fb;border-left:4px solid #1f77b4;padding:8px 12px}\
.meta{color:#666;font-size:12px}.outcome{color:#b00}.advice li{margin:4px 0}\
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}\
th{background:#f6f6f6}.legend span{margin-right:14px;font-size:12px}.legend i{display:inline-block;width:12px;height:3px;margin-right:4px;vertical-align:middle}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_sender_named_is_escaped() {
        assert_eq!(
            esc("<script>alert('x')</script>&\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"
        );
    }
}
