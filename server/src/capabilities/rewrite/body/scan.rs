//! The one-pass read of a `log-batch` body: a JSON scanner written for the one shape the write
//! path sees on nearly every request, so that the common batch is read without serde's generic
//! machinery (a fifth of a write's instructions went to it).
//!
//! It accepts exactly what serde_json accepts for the values it reads (strings without control
//! characters and with valid escapes, numbers in JSON's grammar, the three literals, JSON's four
//! whitespace characters, no trailing commas) and gives up (`None`) wherever it could differ: any
//! error, a name holding an escape, nesting deeper than [`DEPTH`]. The general read then decides,
//! with its own errors. A property test holds the two to the same answer (`shell::fuzz`).

use super::{Fields, OnePass, Placed, ENVELOPE, METRIC, METRICS};

/// The deepest nesting read here; serde_json's limit is 128, and a body deeper than this one is
/// left to it.
const DEPTH: usize = 64;

/// Reads a `log-batch` body in one pass: its top-level fields (`metrics` left unset) and each
/// metric element's fields and place. `None` where it cannot tell exactly what the general read
/// finds (see the module): also a `metrics` that is not an array of objects or is empty, and an
/// element without fields.
pub(super) fn batch(text: &str) -> Option<OnePass<'_>> {
    let mut scan = Scan {
        text,
        at: 0,
        depth: 0,
    };
    let mut envelope = Fields::empty();
    let mut metrics = None;
    scan.space();
    scan.members(|scan, name| {
        if name == ENVELOPE[METRICS] {
            if metrics.is_some() {
                return None;
            }
            metrics = Some(scan.elements()?);
            return Some(());
        }
        match envelope.place(&ENVELOPE, name).ok()? {
            Some(slot) => *slot = Some(scan.value()?),
            None => {
                scan.value()?;
            }
        }
        Some(())
    })?;
    scan.space();
    (scan.at == text.len()).then_some((envelope, metrics))
}

/// The bytes that end a string's plain text: its closing quote, an escape, a control character.
const STOPS: [bool; 256] = {
    let mut stops = [false; 256];
    let mut byte = 0;
    while byte < 0x20 {
        stops[byte] = true;
        byte += 1;
    }
    stops[b'"' as usize] = true;
    stops[b'\\' as usize] = true;
    stops
};

struct Scan<'a> {
    text: &'a str,
    at: usize,
    depth: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= DEPTH).then_some(())
    }

    /// An object's members, each name (without escapes) handed to `each` with the scanner at its
    /// value; where the object starts and ends.
    fn members(
        &mut self,
        mut each: impl FnMut(&mut Self, &'a str) -> Option<()>,
    ) -> Option<std::ops::Range<usize>> {
        let start = self.at;
        self.eat(b'{')?;
        self.enter()?;
        self.space();
        if self.eat(b'}').is_none() {
            loop {
                let name = self.name()?;
                self.space();
                self.eat(b':')?;
                self.space();
                each(self, name)?;
                self.space();
                if self.eat(b',').is_none() {
                    self.eat(b'}')?;
                    break;
                }
                self.space();
            }
        }
        self.depth -= 1;
        Some(start..self.at)
    }

    /// The `metrics` array: each element with its place, and the array's own place.
    fn elements(&mut self) -> Option<(Vec<Placed<'a>>, std::ops::Range<usize>)> {
        let start = self.at;
        self.eat(b'[')?;
        self.enter()?;
        let mut elements = Vec::with_capacity(16);
        loop {
            self.space();
            let mut fields = Fields::empty();
            let mut named = false;
            let span = self.members(|scan, name| {
                named = true;
                match fields.place(&METRIC, name).ok()? {
                    Some(slot) => *slot = Some(scan.value()?),
                    None => {
                        scan.value()?;
                    }
                }
                Some(())
            })?;
            if !named {
                return None;
            }
            elements.push(Placed { fields, span });
            self.space();
            if self.eat(b',').is_none() {
                self.eat(b']')?;
                break;
            }
        }
        self.depth -= 1;
        Some((elements, start..self.at))
    }

    /// A member's name: the text between its quotes; `None` where it holds an escape.
    fn name(&mut self) -> Option<&'a str> {
        let start = self.at;
        if self.string()? {
            return None;
        }
        Some(&self.text[start + 1..self.at - 1])
    }

    /// A string, from its opening quote to past its closing one; whether it held an escape.
    fn string(&mut self) -> Option<bool> {
        self.eat(b'"')?;
        let bytes = self.text.as_bytes();
        let mut escaped = false;
        loop {
            // Most of a string is plain text: found whole, to the byte that ends it.
            let rest = bytes.get(self.at..)?;
            let stop = rest.iter().position(|&b| STOPS[usize::from(b)])?;
            self.at += stop + 1;
            match rest[stop] {
                b'"' => return Some(escaped),
                b'\\' => {
                    escaped = true;
                    match *bytes.get(self.at)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.at += 1,
                        b'u' => {
                            let hex = bytes.get(self.at + 1..self.at + 5)?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return None;
                            }
                            self.at += 5;
                        }
                        _ => return None,
                    }
                }
                // A control character, which JSON allows only escaped.
                _ => return None,
            }
        }
    }

    /// One value (the scanner at its first byte): its text.
    fn value(&mut self) -> Option<&'a str> {
        let start = self.at;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'{' => {
                self.at += 1;
                self.enter()?;
                self.space();
                if self.eat(b'}').is_none() {
                    loop {
                        self.string()?;
                        self.space();
                        self.eat(b':')?;
                        self.space();
                        self.value()?;
                        self.space();
                        if self.eat(b',').is_none() {
                            self.eat(b'}')?;
                            break;
                        }
                        self.space();
                    }
                }
                self.depth -= 1;
            }
            b'[' => {
                self.at += 1;
                self.enter()?;
                self.space();
                if self.eat(b']').is_none() {
                    loop {
                        self.value()?;
                        self.space();
                        if self.eat(b',').is_none() {
                            self.eat(b']')?;
                            break;
                        }
                        self.space();
                    }
                }
                self.depth -= 1;
            }
            b't' => self.literal("true")?,
            b'f' => self.literal("false")?,
            b'n' => self.literal("null")?,
            _ => self.number()?,
        }
        Some(&self.text[start..self.at])
    }

    fn literal(&mut self, word: &str) -> Option<()> {
        self.text[self.at..]
            .starts_with(word)
            .then(|| self.at += word.len())
    }

    /// A number in JSON's grammar: `-`, one `0` or digits not led by `0`, a fraction, an exponent.
    fn number(&mut self) -> Option<()> {
        self.eat(b'-');
        match self.peek()? {
            b'0' => {
                self.at += 1;
                if self.peek().is_some_and(|b| b.is_ascii_digit()) {
                    return None;
                }
            }
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            self.peek().filter(u8::is_ascii_digit)?;
            self.digits();
        }
        Some(())
    }

    fn digits(&mut self) {
        let rest = &self.text.as_bytes()[self.at..];
        self.at += rest.iter().take_while(|b| b.is_ascii_digit()).count();
    }
}
