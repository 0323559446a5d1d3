//! Which metric writes the rewriter would send on exactly as they came, told before they are
//! read: a body in which no string starts with `system/` (no key of the contract's), written
//! without a single escape, its top-level fields each named once and its run named by `run_id`
//! alone. Such a body carries the run's own metrics: the contract renames nothing in it,
//! deduplication keeps all of it, and [`super::body::MetricsBody::parse`] finds no conflict in it
//! (two spellings of the run, or a field named twice). So it may go to MLflow at once, and be
//! read while MLflow stores it (see `capabilities::metric_routes`).
//!
//! The check is a byte scan, stricter than JSON: anything it is unsure of (an escape, a repeated
//! field, a `system/` prefix in any string, a malformed value) makes it answer `None`, and the
//! body is read first as before. It does not validate the body: a body it passes that is not
//! JSON goes to MLflow as it came and gets MLflow's answer, as it would after the read.

use mlscope_scopes::SYSTEM_PREFIX;

/// The most top-level fields a body the scan passes may have (a `log-batch` has four, a
/// `log-metric` up to eight).
const MAX_FIELDS: usize = 16;

/// The run a write body names, when the rewriter would send the body exactly as it came (see the
/// module's documentation) and MLflow would take the run's id as one; `None` otherwise.
pub fn plain_run(body: &[u8]) -> Option<&str> {
    if body.contains(&b'\\') {
        return None;
    }
    let mut scan = Scan { body, at: 0 };
    scan.expect(b'{')?;
    let mut names: [&[u8]; MAX_FIELDS] = [&[]; MAX_FIELDS];
    let mut fields = 0;
    let mut run = None;
    if scan.peek() == Some(b'}') {
        return None;
    }
    loop {
        let name = scan.string()?;
        if fields == MAX_FIELDS || names[..fields].contains(&name) {
            return None;
        }
        names[fields] = name;
        fields += 1;
        scan.expect(b':')?;
        match name {
            b"run_id" => run = Some(scan.string()?),
            b"runId" | b"run_uuid" | b"runUuid" => return None,
            _ => scan.value()?,
        }
        match scan.next()? {
            b',' => {}
            b'}' => break,
            _ => return None,
        }
    }
    if scan.peek().is_some() {
        return None;
    }
    let run = std::str::from_utf8(run?).ok()?;
    crate::plumbing::writes::is_valid_run_id(run).then_some(run)
}

/// A cursor over a body without escapes.
struct Scan<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Scan<'a> {
    /// The next byte that is not JSON whitespace, not taken.
    fn peek(&mut self) -> Option<u8> {
        while let Some(&b) = self.body.get(self.at) {
            if !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(b);
            }
            self.at += 1;
        }
        None
    }

    /// The next byte that is not JSON whitespace, taken.
    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// A string's contents; `None` where the next token is no string or the string starts
    /// with the contract's prefix.
    fn string(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.at;
        let len = self.body[start..].iter().position(|&b| b == b'"')?;
        self.at = start + len + 1;
        let text = &self.body[start..start + len];
        (!text.starts_with(SYSTEM_PREFIX.as_bytes())).then_some(text)
    }

    /// Skips one value: a string, an object or array (every string in it checked as
    /// [`Scan::string`] checks), or a scalar (a run of the bytes a number or literal is made of).
    fn value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth = depth.checked_sub(1)?;
                            if depth == 0 {
                                self.at += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.at += 1;
                }
            }
            _ => {
                let start = self.at;
                while self
                    .body
                    .get(self.at)
                    .is_some_and(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'+' | b'.'))
                {
                    self.at += 1;
                }
                (self.at > start).then_some(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::plain_run;

    #[test]
    fn the_runs_own_metrics_written_plainly_name_their_run() {
        let batch = br#"{"run_id": "abc123", "metrics": [{"key": "loss", "value": 0.5, "timestamp": 1, "step": 2}, {"key": "acc", "value": "NaN", "timestamp": 1, "step": 2}], "params": [{"key": "lr", "value": "0.1"}], "tags": []}"#;
        assert_eq!(plain_run(batch), Some("abc123"));
        let metric = br#"{"run_id":"r-1","key":"loss","value":1e-3,"timestamp":-1,"step":0}"#;
        assert_eq!(plain_run(metric), Some("r-1"));
        let spaced = b" \r\n{ \"metrics\" : [ ] ,\t\"run_id\" : \"r\" } \n";
        assert_eq!(plain_run(spaced), Some("r"));
        // A prefix elsewhere than at a string's start is not the contract's.
        let inner =
            br#"{"run_id":"r","metrics":[{"key":"my/system/x","value":1,"timestamp":1,"step":0}]}"#;
        assert_eq!(plain_run(inner), Some("r"));
    }

    #[test]
    fn anything_the_contract_or_the_parser_might_act_on_is_read_first() {
        for body in [
            // A key of the contract's, in a batch or a log-metric, or any string so starting.
            &br#"{"run_id":"r","metrics":[{"key":"system/cpu_utilization_percentage","value":1,"timestamp":1,"step":0}]}"#[..],
            br#"{"run_id":"r","key":"system/gpu_0_utilization_percentage","value":1,"timestamp":1}"#,
            br#"{"run_id":"r","tags":[{"key":"note","value":"system/x"}]}"#,
            // An escape anywhere (it could spell the prefix, or a quote).
            br#"{"run_id":"r","metrics":[{"key":"\u0073ystem/cpu","value":1,"timestamp":1,"step":0}]}"#,
            br#"{"run_id":"r","tags":[{"key":"a\"b","value":"c"}]}"#,
            // The run spelled otherwise, twice, or not at all.
            br#"{"run_uuid":"r","metrics":[]}"#,
            br#"{"run_id":"r","runId":"s","metrics":[]}"#,
            br#"{"run_id":"r","run_id":"s","metrics":[]}"#,
            br#"{"metrics":[]}"#,
            br#"{"run_id":5,"metrics":[]}"#,
            br#"{"run_id":"not a run id","metrics":[]}"#,
            // A field named twice.
            br#"{"run_id":"r","metrics":[],"metrics":[{"key":"a","value":1,"timestamp":1,"step":0}]}"#,
            // Not an object, not closed, or something after it.
            br#"["run_id","r"]"#,
            br#"{"run_id":"r","metrics":[}"#,
            br#"{"run_id":"r","metrics":[]"#,
            br#"{"run_id":"r"} {"run_id":"s"}"#,
            br#"{}"#,
            b"",
        ] {
            assert_eq!(plain_run(body), None, "{}", String::from_utf8_lossy(body));
        }
    }

    /// Every body the scan passes is one the rewriter's own read finds nothing to change or
    /// refuse in, naming the same run.
    #[test]
    fn what_the_scan_passes_the_read_sends_as_it_came() {
        use crate::capabilities::rewrite::body::{Endpoint, MetricsBody};
        for body in [
            &br#"{"run_id":"abc","metrics":[{"key":"loss","value":0.5,"timestamp":1,"step":2}],"params":[],"tags":[]}"#[..],
            br#"{"run_id":"abc","metrics":[{"key":"loss","value":0.5,"timestamp":1,"step":2,"model_id":"m"}],"unknown":{"a":[1,{"b":null}]}}"#,
            br#"{"run_id":"abc","metrics":[{"key":"loss","value":"x","timestamp":true,"step":2}]}"#,
        ] {
            assert_eq!(plain_run(body), Some("abc"));
            match MetricsBody::parse(body, Endpoint::LogBatch) {
                Ok(parsed) => {
                    assert_eq!(parsed.run_id.as_deref(), Some("abc"));
                    assert!(parsed.metrics.iter().all(|m| !m.key.starts_with("system/")));
                }
                Err(crate::capabilities::rewrite::body::BodyError::Unreadable(_)) => {}
                Err(other) => panic!("{other:?} for {}", String::from_utf8_lossy(body)),
            }
        }
    }
}
