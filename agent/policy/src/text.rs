//! Text a plugin wrote, made safe to show: in the agent's log, in an error an operator's
//! terminal prints, in `gpuvisor plugin test`. One rule for every such text (log lines,
//! stdout/stderr lines, reject reasons, grace reasons, error messages, trap messages,
//! ranked entries the agent drops): control characters and the Unicode direction
//! overrides are escaped (`\n`, `\u{1b}`, `\u{202e}`, ...), so a plugin cannot start a
//! line of its own, move the cursor or colour a terminal; and the text is cut to a bound
//! on a character boundary, marked with `…`.

use std::borrow::Cow;

/// The longest plugin text kept in an error or an answer's reason, bytes (as the plugin's
/// own error messages).
pub const MAX_TEXT_BYTES: usize = 1024;

/// True for the characters [`printable`] escapes: controls (C0, DEL, C1) and the
/// bidirectional formatting characters (which reorder what a terminal shows).
fn escaped(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every control and direction-override character escaped as Rust's
/// `char::escape_debug` writes it (`\n`, `\t`, `\u{1b}`); everything else as is.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(escaped) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if escaped(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Cuts `s` to at most `max` bytes on a char boundary; true when it was longer.
pub(crate) fn cut_to(s: &mut String, max: usize) -> bool {
    if s.len() <= max {
        return false;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    true
}

/// `s` made [`printable`] and cut to `max` bytes (an ellipsis marks a cut).
pub fn shown(s: &str, max: usize) -> String {
    // Escaping first: the bound holds for what is shown.
    let mut out = printable(s).into_owned();
    if cut_to(&mut out, max) {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_direction_overrides_are_escaped_the_rest_kept() {
        assert_eq!(printable("plain, été"), "plain, été");
        assert!(matches!(printable("plain"), Cow::Borrowed(_)));
        assert_eq!(printable("a\nb\r\u{1b}[31mc\td\u{7f}\u{9b}"), "a\\nb\\r\\u{1b}[31mc\\td\\u{7f}\\u{9b}");
        assert_eq!(printable("x\u{202e}y\u{2066}"), "x\\u{202e}y\\u{2066}");
    }

    #[test]
    fn shown_text_is_cut_on_a_char_boundary_after_escaping() {
        assert_eq!(shown("ééé", 3), "é…");
        assert_eq!(shown("\n\n\n", 4), "\\n\\n…");
        assert_eq!(shown("short", 1024), "short");
    }
}
