//! Output constrained to one JSON object (OpenAI's `response_format: {"type": "json_object"}`,
//! llama.cpp's JSON grammar): a recognizer of the prefixes of such a text, fed byte by byte, which
//! the generator asks whether a token may come next.

/// What the generated text must be.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputFormat {
    /// Any text.
    #[default]
    Text,
    /// One JSON object (RFC 8259), nothing after it: generation ends when it closes.
    JsonObject,
}

/// Most spaces and tabs in a row outside strings, besides one line break (llama.cpp's JSON grammar:
/// `ws ::= | " " | "\n" [ \t]{0,20}`): a model cannot stall the text on whitespace.
const MAX_SPACES: u8 = 20;
/// Most containers open at once.
const MAX_DEPTH: usize = 64;

/// What the structure expects next (outside a string, number or literal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    /// The top-level object's `{`.
    Top,
    /// A key or `}` (after `{`).
    KeyOrClose,
    /// A key (after `,` in an object).
    Key,
    /// `:` after a key.
    Colon,
    /// A member's value (after `:`).
    MemberValue,
    /// `,` or `}` after a member.
    MemberEnd,
    /// A value or `]` (after `[`).
    ItemOrClose,
    /// A value (after `,` in an array).
    Item,
    /// `,` or `]` after an item.
    ItemEnd,
    /// Nothing: the top-level object is closed.
    Done,
}

/// The token being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lex {
    /// None: structure.
    Structure,
    /// A string (a key or a value), after `\` when `escaped`, with `hex` digits of `\u` left.
    Str { key: bool, escaped: bool, hex: u8 },
    /// A number, in this state.
    Num(Num),
    /// A literal (`true`, `false`, `null`) read up to `at`.
    Lit { word: &'static [u8], at: usize },
}

/// States of a JSON number: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl Num {
    /// The state after `b`, or `None` when `b` does not continue the number.
    fn next(self, b: u8) -> Option<Num> {
        use Num::*;
        let digit = b.is_ascii_digit();
        match (self, b) {
            (Minus, b'0') => Some(Zero),
            (Minus, _) if digit => Some(Int),
            (Int, _) if digit => Some(Int),
            (Zero | Int, b'.') => Some(Dot),
            (Dot | Frac, _) if digit => Some(Frac),
            (Zero | Int | Frac, b'e' | b'E') => Some(Exp),
            (Exp, b'+' | b'-') => Some(ExpSign),
            (Exp | ExpSign | ExpDigits, _) if digit => Some(ExpDigits),
            _ => None,
        }
    }

    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }
}

/// The prefix of a JSON object read so far: [`feed`](JsonObjectPrefix::feed) says whether a byte
/// keeps it a prefix of one JSON object.
#[derive(Clone, Copy, Debug)]
pub struct JsonObjectPrefix {
    /// Open containers: bit `i` set when the `i`-th from the outside is an object (a copy
    /// costs nothing: the generator copies the state for every token it checks).
    objects: u64,
    /// How many containers are open.
    depth: u8,
    want: Want,
    lex: Lex,
    /// Spaces and tabs in the current run of whitespace.
    spaces: u8,
    /// Whether the current run of whitespace has its line break.
    line_break: bool,
    /// Inside a string: continuation bytes the current UTF-8 character still needs, and the range
    /// of the next one.
    utf8_left: u8,
    utf8_next: (u8, u8),
}

impl Default for JsonObjectPrefix {
    fn default() -> Self {
        JsonObjectPrefix {
            objects: 0,
            depth: 0,
            want: Want::Top,
            lex: Lex::Structure,
            spaces: 0,
            line_break: false,
            utf8_left: 0,
            utf8_next: (0, 0),
        }
    }
}

impl JsonObjectPrefix {
    /// Nothing read yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the object is complete (nothing may follow).
    pub fn is_complete(&self) -> bool {
        self.want == Want::Done
    }

    /// Reads `bytes`; `false` (the state then undefined) when they do not continue the prefix.
    pub fn feed_all(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.feed(b))
    }

    /// Reads one byte; `false` (the state then undefined) when it does not continue the prefix.
    pub fn feed(&mut self, b: u8) -> bool {
        match self.lex {
            Lex::Structure => self.structure(b),
            Lex::Str { key, escaped: true, .. } => match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                    self.lex = Lex::Str { key, escaped: false, hex: 0 };
                    true
                }
                b'u' => {
                    self.lex = Lex::Str { key, escaped: false, hex: 4 };
                    true
                }
                _ => false,
            },
            Lex::Str { key, hex: left @ 1.., .. } => {
                self.lex = Lex::Str { key, escaped: false, hex: left - 1 };
                b.is_ascii_hexdigit()
            }
            Lex::Str { .. } if self.utf8_left > 0 => {
                let (lo, hi) = self.utf8_next;
                self.utf8_left -= 1;
                self.utf8_next = (0x80, 0xbf);
                (lo..=hi).contains(&b)
            }
            Lex::Str { key, .. } => match b {
                b'"' => {
                    self.lex = Lex::Structure;
                    if key {
                        self.want = Want::Colon;
                    } else {
                        self.value_done();
                    }
                    true
                }
                b'\\' => {
                    self.lex = Lex::Str { key, escaped: true, hex: 0 };
                    true
                }
                0x20..=0x7f => true,
                // The first byte of a multi-byte character (RFC 3629's well-formed sequences).
                _ => {
                    let (left, next) = match b {
                        0xc2..=0xdf => (1, (0x80, 0xbf)),
                        0xe0 => (2, (0xa0, 0xbf)),
                        0xed => (2, (0x80, 0x9f)),
                        0xe1..=0xef => (2, (0x80, 0xbf)),
                        0xf0 => (3, (0x90, 0xbf)),
                        0xf1..=0xf3 => (3, (0x80, 0xbf)),
                        0xf4 => (3, (0x80, 0x8f)),
                        _ => return false,
                    };
                    (self.utf8_left, self.utf8_next) = (left, next);
                    true
                }
            },
            Lex::Lit { word, at } => {
                if b != word[at] {
                    return false;
                }
                if at + 1 == word.len() {
                    self.lex = Lex::Structure;
                    self.value_done();
                } else {
                    self.lex = Lex::Lit { word, at: at + 1 };
                }
                true
            }
            Lex::Num(n) => match n.next(b) {
                Some(next) => {
                    self.lex = Lex::Num(next);
                    true
                }
                // The byte after a number belongs to the structure around it.
                None if n.complete() => {
                    self.lex = Lex::Structure;
                    self.value_done();
                    self.structure(b)
                }
                None => false,
            },
        }
    }

    /// A byte outside strings, numbers and literals.
    fn structure(&mut self, b: u8) -> bool {
        match b {
            // (None before the object, as llama.cpp's `root ::= object`, nor after it.)
            b' ' | b'\t' => {
                self.spaces += 1;
                return !matches!(self.want, Want::Top | Want::Done) && self.spaces <= MAX_SPACES;
            }
            b'\n' => {
                let first = !std::mem::replace(&mut self.line_break, true);
                return !matches!(self.want, Want::Top | Want::Done) && first && self.spaces == 0;
            }
            _ => {}
        }
        (self.spaces, self.line_break) = (0, false);
        match (self.want, b) {
            (Want::Top, b'{') => self.open(true),
            (Want::KeyOrClose | Want::Key, b'"') => {
                self.lex = Lex::Str { key: true, escaped: false, hex: 0 };
                true
            }
            (Want::Colon, b':') => {
                self.want = Want::MemberValue;
                true
            }
            (Want::MemberEnd, b',') => {
                self.want = Want::Key;
                true
            }
            (Want::ItemEnd, b',') => {
                self.want = Want::Item;
                true
            }
            (Want::KeyOrClose | Want::MemberEnd, b'}') | (Want::ItemOrClose | Want::ItemEnd, b']') => {
                self.depth -= 1;
                self.value_done();
                true
            }
            (Want::MemberValue | Want::Item | Want::ItemOrClose, _) => self.value(b),
            _ => false,
        }
    }

    /// The first byte of a value.
    fn value(&mut self, b: u8) -> bool {
        self.lex = match b {
            b'{' => return self.open(true),
            b'[' => return self.open(false),
            b'"' => Lex::Str { key: false, escaped: false, hex: 0 },
            b't' => Lex::Lit { word: b"true", at: 1 },
            b'f' => Lex::Lit { word: b"false", at: 1 },
            b'n' => Lex::Lit { word: b"null", at: 1 },
            b'-' => Lex::Num(Num::Minus),
            b'0' => Lex::Num(Num::Zero),
            b'1'..=b'9' => Lex::Num(Num::Int),
            _ => return false,
        };
        true
    }

    /// Opens an object or an array.
    fn open(&mut self, object: bool) -> bool {
        if self.depth as usize == MAX_DEPTH {
            return false;
        }
        self.objects = (self.objects & !(1 << self.depth)) | (u64::from(object) << self.depth);
        self.depth += 1;
        self.want = if object { Want::KeyOrClose } else { Want::ItemOrClose };
        true
    }

    /// A value (or the container just closed) is complete.
    fn value_done(&mut self) {
        self.want = match self.depth {
            0 => Want::Done,
            d if self.objects >> (d - 1) & 1 == 1 => Want::MemberEnd,
            _ => Want::ItemEnd,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Option<JsonObjectPrefix> {
        let mut p = JsonObjectPrefix::new();
        p.feed_all(text.as_bytes()).then_some(p)
    }

    #[test]
    fn whole_objects_are_complete() {
        for text in [
            "{}",
            "{\"a\": 1}",
            "{\"a\":[1,-0.5,2e10,3E-2,0,true,false,null,{},[]],\"b\":{\"c\":\"x\\\"y\\\\z\\u00e9\\n\"}}",
            "{\n  \"name\": \"Élodie 猫\",\n  \"age\": -12.25e+3\n}",
            "{\"\":\"\"}",
        ] {
            let p = read(text).unwrap_or_else(|| panic!("{text:?} is rejected"));
            assert!(p.is_complete(), "{text:?}");
            assert!(serde_json::from_str::<serde_json::Value>(text).unwrap().is_object(), "{text:?}");
            // Nothing may follow, not even whitespace.
            assert!(!p.clone().feed(b' ') && !p.clone().feed(b'{'), "{text:?}");
        }
    }

    #[test]
    fn prefixes_are_accepted_and_incomplete() {
        for text in
            ["", "{", "{\"a", "{\"a\"", "{\"a\":", "{\"a\": [1, 2", "{\"a\":-", "{\"a\":1.", "{\"a\":\"\\u00", "{\"a\":tr", "{\"a\":{}"]
        {
            let p = read(text).unwrap_or_else(|| panic!("{text:?} is rejected"));
            assert!(!p.is_complete(), "{text:?}");
        }
    }

    #[test]
    fn what_json_forbids_is_rejected() {
        for text in [
            " {}",
            "\n{}",
            "[1]",
            "\"a\"",
            "1",
            "{a:1}",
            "{'a':1}",
            "{\"a\" 1}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":1,}",
            "{\"a\":[1,]}",
            "{\"a\":tru}",
            "{\"a\":-}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u00g0\"}",
            "{\"a\":\"line\nbreak\"}",
            "{\"a\":\"\u{0}\"}",
            "{\"a\":1]",
            "{}}",
            "{} ",
            "{\"a\":1}x",
        ] {
            assert!(read(text).is_none(), "{text:?} is accepted");
        }
        // Strings hold well-formed UTF-8 only.
        for bad in
            [&b"{\"\xff"[..], b"{\"\xc3\x28", b"{\"\xe0\x80", b"{\"\xed\xa0", b"{\"\xf4\x90", b"{\"\x80", b"{\"\xc3\"", b"{\"\xe2\x82\""]
        {
            assert!(!JsonObjectPrefix::new().feed_all(bad), "{bad:?}");
        }
        assert!(JsonObjectPrefix::new().feed_all("{\"é€𝄞\":\"\u{7f}\"".as_bytes()));
        // Runs of whitespace (one line break, then at most 20 spaces or tabs) and nesting are
        // bounded.
        assert!(read(&format!("{{\n{}", " ".repeat(MAX_SPACES as usize))).is_some());
        assert!(read(&format!("{{\n{}", " ".repeat(MAX_SPACES as usize + 1))).is_none());
        assert!(read("{\n\n").is_none() && read("{ \n").is_none() && read("{\r\n").is_none());
        assert!(read("{\n \"a\":\n  [\n    1\n  ]\n}").is_some_and(|p| p.is_complete()));
        assert!(read(&format!("{{\"a\":{}", "[".repeat(MAX_DEPTH - 1))).is_some());
        assert!(read(&format!("{{\"a\":{}", "[".repeat(MAX_DEPTH))).is_none());
    }
}
