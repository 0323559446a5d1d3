//! The JSON log lines (`--log-format json`): what tracing-subscriber's JSON format writes (the
//! event's fields flattened, its target, and the current span's fields under `span`), written
//! for less. Every request makes a span and a log line, and the stock format builds a map to
//! format a span's fields, then parses them back out of their text for each line.
//!
//! - [`SpanFields`] formats a span's fields straight to a JSON object, in the order they were
//!   declared.
//! - [`JsonLines`] writes the proxy's own events directly, with that object copied in as it is.
//!   Events of other crates (and of the `log` crate, whose metadata is normalized) still go
//!   through tracing-subscriber's own JSON format, which reads the same span objects.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::{self, Format, Json, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// A span's fields as one JSON object (`{"request_id":"…","route":"…"}`), in declaration
/// order; fields recorded later are appended.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SpanFields;

impl<'writer> FormatFields<'writer> for SpanFields {
    fn format_fields<R: RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        // Built in a buffer of the thread's and written at once: the span's own text then grows
        // once, not at every small write (a request's span is made on its path to MLflow).
        SCRATCH.with(|scratch| {
            let Ok(mut text) = scratch.try_borrow_mut() else {
                return span_object(&mut writer, fields);
            };
            text.clear();
            let result = span_object(&mut *text, fields);
            writer.write_str(&text)?;
            result
        })
    }

    fn add_fields(
        &self,
        current: &'writer mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        // `{…}` becomes `{…,` and takes the new entries before its brace again.
        let had_entries = match current.fields.strip_suffix('}') {
            Some(open) => {
                let had = open.len() > 1;
                current.fields.truncate(open.len());
                had
            }
            None => {
                current.fields.clear();
                current.fields.push('{');
                false
            }
        };
        let mut text = std::mem::take(&mut current.fields);
        let mut visitor = Entries::new(&mut text, had_entries);
        fields.record(&mut visitor);
        let result = visitor.result;
        text.push('}');
        current.fields = text;
        result
    }
}

thread_local! {
    /// Where a span's object is built before it is written to the span's own text.
    static SCRATCH: std::cell::RefCell<String> = std::cell::RefCell::new(String::with_capacity(256));
}

/// `fields` as a JSON object.
fn span_object<W: fmt::Write>(out: &mut W, fields: impl RecordFields) -> fmt::Result {
    out.write_char('{')?;
    let mut visitor = Entries::new(out, false);
    fields.record(&mut visitor);
    visitor.result?;
    out.write_char('}')
}

/// The event format of `--log-format json`: see the module's documentation.
pub(crate) struct JsonLines {
    /// tracing-subscriber's JSON format, for events that are not the proxy's own.
    stock: Format<Json, SystemTime>,
}

impl JsonLines {
    pub(crate) fn new() -> Self {
        Self {
            stock: format::format()
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false),
        }
    }
}

impl Default for JsonLines {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> FormatEvent<S, SpanFields> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, SpanFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        if !meta.target().starts_with(env!("CARGO_CRATE_NAME")) {
            return self.stock.format_event(ctx, writer, event);
        }
        writer.write_str("{\"timestamp\":\"")?;
        timestamp(&mut writer)?;
        write!(writer, "\",\"level\":\"{}\"", meta.level())?;
        let mut visitor = Entries::new(&mut writer, true);
        event.record(&mut visitor);
        visitor.result?;
        writer.write_str(",\"target\":")?;
        string(&mut writer, meta.target())?;
        let span = event
            .parent()
            .and_then(|id| ctx.span(id))
            .or_else(|| ctx.lookup_current());
        if let Some(span) = span {
            let extensions = span.extensions();
            let fields = extensions
                .get::<FormattedFields<SpanFields>>()
                .and_then(|f| f.fields.strip_suffix('}'));
            if let Some(open) = fields {
                writer.write_str(",\"span\":")?;
                writer.write_str(open)?;
                if open.len() > 1 {
                    writer.write_char(',')?;
                }
                writer.write_str("\"name\":")?;
                string(&mut writer, span.name())?;
                writer.write_char('}')?;
            }
        }
        writer.write_str("}\n")
    }
}

/// The time now as tracing-subscriber's `SystemTime` writes it (RFC 3339 in UTC, to the
/// microsecond), with the date and the time of day formatted once a second on each thread.
fn timestamp(out: &mut Writer<'_>) -> fmt::Result {
    thread_local! {
        /// The second last written and its text up to the fraction.
        static SECOND: std::cell::Cell<(u64, [u8; 19])> = const { std::cell::Cell::new((u64::MAX, [0; 19])) };
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .filter(|since| since.as_secs() < 253_402_300_800); // before year 10000
    let Some(now) = now else {
        return SystemTime.format_time(out);
    };
    let (second, mut text) = SECOND.get();
    if second != now.as_secs() {
        text = date_and_time(now.as_secs());
        SECOND.set((now.as_secs(), text));
    }
    // ASCII digits and separators only.
    out.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)?;
    write!(out, ".{:06}Z", now.subsec_micros())
}

/// `YYYY-MM-DDTHH:MM:SS` of a time in seconds since the epoch (before year 10000), in UTC.
fn date_and_time(seconds: u64) -> [u8; 19] {
    let (days, of_day) = ((seconds / 86_400) as i64, seconds % 86_400);
    // Days to a civil date: Howard Hinnant's `civil_from_days`, with eras of 400 years from
    // 0000-03-01.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let mut text = *b"0000-00-00T00:00:00";
    let mut put = |at: usize, width: usize, mut value: u64| {
        for digit in text[at..at + width].iter_mut().rev() {
            *digit = b'0' + (value % 10) as u8;
            value /= 10;
        }
    };
    put(0, 4, year as u64);
    put(5, 2, month as u64);
    put(8, 2, day as u64);
    put(11, 2, of_day / 3_600);
    put(14, 2, of_day / 60 % 60);
    put(17, 2, of_day % 60);
    text
}

/// Writes `"name":value` entries, each after a comma unless it is the first, as
/// tracing-subscriber's JSON format writes the value of each kind.
struct Entries<'a, W: fmt::Write> {
    out: &'a mut W,
    comma: bool,
    result: fmt::Result,
}

impl<'a, W: fmt::Write> Entries<'a, W> {
    fn new(out: &'a mut W, comma: bool) -> Self {
        Self {
            out,
            comma,
            result: Ok(()),
        }
    }

    fn entry(&mut self, field: &Field, value: impl FnOnce(&mut W) -> fmt::Result) {
        // What the `log` crate's records carry is their metadata, not fields.
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        self.result = (|| {
            if self.comma {
                self.out.write_char(',')?;
            }
            self.comma = true;
            string(self.out, field.name())?;
            self.out.write_char(':')?;
            value(self.out)
        })();
    }
}

impl<W: fmt::Write> Visit for Entries<'_, W> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.entry(field, |out| number(out, value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.entry(field, |out| write!(out, "{value}"));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.entry(field, |out| write!(out, "{value}"));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.entry(field, |out| write!(out, "{value}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.entry(field, |out| string(out, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.entry(field, |out| {
            out.write_char('"')?;
            write!(Escaped(out), "{value:?}")?;
            out.write_char('"')
        });
    }
}

/// A JSON number as serde_json writes an `f64`: `null` where it is not finite, and a whole
/// value with its `.0`.
fn number(out: &mut impl fmt::Write, value: f64) -> fmt::Result {
    if !value.is_finite() {
        return out.write_str("null");
    }
    let mut text = String::with_capacity(24);
    write!(text, "{value}")?;
    out.write_str(&text)?;
    if !text.contains(['.', 'e', 'E']) {
        out.write_str(".0")?;
    }
    Ok(())
}

/// `value` as a JSON string.
fn string(out: &mut impl fmt::Write, value: &str) -> fmt::Result {
    out.write_char('"')?;
    Escaped(out).write_str(value)?;
    out.write_char('"')
}

/// Escapes what it is given as the inside of a JSON string (as serde_json does: quotes,
/// backslashes and control characters).
struct Escaped<'a, W: fmt::Write>(&'a mut W);

impl<W: fmt::Write> fmt::Write for Escaped<'_, W> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        // Most text needs no escape: one scan, one write.
        if !text.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
            return self.0.write_str(text);
        }
        let mut plain = 0;
        for (at, byte) in text.bytes().enumerate() {
            let escape = match byte {
                b'"' => "\\\"",
                b'\\' => "\\\\",
                b'\n' => "\\n",
                b'\r' => "\\r",
                b'\t' => "\\t",
                0x08 => "\\b",
                0x0c => "\\f",
                0x00..=0x1f => "",
                _ => continue,
            };
            self.0.write_str(&text[plain..at])?;
            if escape.is_empty() {
                write!(self.0, "\\u{byte:04x}")?;
            } else {
                self.0.write_str(escape)?;
            }
            plain = at + 1;
        }
        self.0.write_str(&text[plain..])
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tracing_subscriber::fmt::MakeWriter;

    /// A log writer that keeps what it is given, for tests to read.
    #[derive(Clone, Default)]
    pub(crate) struct Capture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Capture {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Capture {
        type Writer = Capture;
        fn make_writer(&'a self) -> Capture {
            self.clone()
        }
    }

    impl Capture {
        /// Everything written so far.
        pub(crate) fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }

        /// Every line written, parsed, with its timestamp checked and taken out.
        fn lines(&self) -> Vec<serde_json::Value> {
            self.text()
                .lines()
                .map(|line| {
                    let mut value: serde_json::Value =
                        serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
                    let stamp = value.as_object_mut().unwrap().remove("timestamp").unwrap();
                    let stamp = stamp.as_str().unwrap();
                    assert!(stamp.len() > 20 && stamp.ends_with('Z'), "{stamp}");
                    value
                })
                .collect()
        }
    }

    /// Events of every kind of field value, in and out of spans, with text that needs escaping.
    fn emit() {
        #[derive(Debug)]
        struct Shown {
            #[allow(dead_code)]
            text: &'static str,
        }
        let error = std::io::Error::other("disk \"full\"\n");
        tracing::info!(
            status = 200u16,
            latency_ms = 0.25,
            whole = 3.0,
            huge = 1e300,
            nan = f64::NAN,
            negative = -7i64,
            flag = true,
            nothing = Option::<f64>::None,
            something = Some(1.5),
            "answered"
        );
        let path = "/api/2.0/mlflow/runs/get?\"q\"\\\u{1}\t\u{7f}é";
        let span = tracing::info_span!("request", request_id = "a-b", route = "runs", method = %"POST", path);
        let _entered = span.enter();
        tracing::warn!(error = %error, shown = ?Shown { text: "a\"b" }, "upstream said {}", "no");
        let inner = tracing::info_span!("empty");
        inner.in_scope(|| tracing::error!(bytes = ?b"ab", "in an empty span"));
        let recorded = tracing::info_span!("late", first = 1u64, second = tracing::field::Empty);
        recorded.record("second", "two");
        recorded.in_scope(|| tracing::debug!(answered_by = "mlflow", "recorded later"));
    }

    /// The same events through tracing-subscriber's JSON format and through ours read back as
    /// the same JSON: the only difference is the speed.
    #[test]
    fn lines_read_back_as_the_stock_json_format_writes_them() {
        let ours = Capture::default();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(ours.clone())
            .fmt_fields(SpanFields)
            .event_format(JsonLines::new())
            .finish();
        tracing::subscriber::with_default(subscriber, emit);

        let stock = Capture::default();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(stock.clone())
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .finish();
        tracing::subscriber::with_default(subscriber, emit);

        let (ours, stock) = (ours.lines(), stock.lines());
        assert_eq!(ours.len(), 4);
        assert_eq!(ours, stock);
        // Spot checks, so that both agreeing on something wrong would show.
        assert_eq!(ours[0]["whole"], serde_json::json!(3.0));
        assert_eq!(ours[0]["nan"], serde_json::Value::Null);
        assert!(ours[0].get("nothing").is_none());
        assert_eq!(
            ours[1]["span"]["path"],
            "/api/2.0/mlflow/runs/get?\"q\"\\\u{1}\t\u{7f}é"
        );
        assert_eq!(ours[1]["span"]["name"], "request");
        assert_eq!(ours[1]["message"], "upstream said no");
        assert_eq!(ours[2]["span"], serde_json::json!({ "name": "empty" }));
        assert_eq!(
            ours[3]["span"],
            serde_json::json!({ "first": 1, "second": "two", "name": "late" })
        );
    }

    #[test]
    fn dates_and_times_are_the_civil_calendars() {
        let cases = [
            (0, "1970-01-01T00:00:00"),
            (951_825_600, "2000-02-29T12:00:00"),
            (4_107_542_399, "2100-02-28T23:59:59"),
            (4_107_542_400, "2100-03-01T00:00:00"),
            (1_796_515_199, "2026-12-05T23:59:59"),
            (253_402_300_799, "9999-12-31T23:59:59"),
        ];
        for (seconds, text) in cases {
            assert_eq!(std::str::from_utf8(&date_and_time(seconds)).unwrap(), text);
        }
    }

    /// The cached timestamp reads as the stock one written at the same second.
    #[test]
    fn timestamps_match_tracing_subscribers() {
        // Again where the second turns between the two (a mismatch never reads alike).
        for _ in 0..10 {
            let (mut stock, mut ours) = (String::new(), String::new());
            SystemTime
                .format_time(&mut Writer::new(&mut stock))
                .unwrap();
            timestamp(&mut Writer::new(&mut ours)).unwrap();
            if stock[..19] == ours[..19] {
                assert_eq!(stock.len(), ours.len(), "{stock} against {ours}");
                assert!(ours.ends_with('Z') && ours.as_bytes()[19] == b'.', "{ours}");
                return;
            }
        }
        panic!("the timestamps never read alike to the second");
    }

    /// Events of other crates keep the stock format (and read our span objects).
    #[test]
    fn other_crates_events_go_through_the_stock_format() {
        let ours = Capture::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(ours.clone())
            .fmt_fields(SpanFields)
            .event_format(JsonLines::new())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("request", request_id = "r1");
            let _entered = span.enter();
            tracing::info!(target: "hyper::client", kept = 1u64, "pooled");
        });
        let lines = ours.lines();
        assert_eq!(lines[0]["target"], "hyper::client");
        assert_eq!(lines[0]["kept"], 1);
        assert_eq!(lines[0]["span"]["request_id"], "r1");
    }
}
