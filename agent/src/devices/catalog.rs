//! Parser of `nvidia/creatable_vgpu_types` (docs/design/host.md §3.1).
//!
//! The driver prints a header (`ID    : vGPU Name`) then one line per type: the decimal id
//! left-aligned in 5 columns, ` : `, the full name. The parser is tolerant and no single
//! line can fail the catalog: LF or CRLF; blank lines skipped; the header (first token
//! `ID`, any case) skipped; an entry split at its first `:` or else at the first run of
//! whitespace; the id a decimal u32 of any width other than `0` (`0` means "no vGPU" in
//! `current_vgpu_type`, so it is never a type); the name non-empty and more than the
//! vendor word (`1148 : NVIDIA` names no profile). Malformed lines are kept
//! in [`Catalog::skipped`] for the caller to report with the VF's name and count —
//! skipping only hides capacity, it never causes a destructive action.

/// The vendor word that prefixes every type name (`NVIDIA L40S-2Q`): alone, it names no
/// profile.
const VENDOR_WORD: &str = "NVIDIA";

/// One creatable vGPU type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogEntry {
    /// The type id as written to `current_vgpu_type` (decimal in sysfs).
    pub id: u32,
    /// The full sysfs name, e.g. `NVIDIA L40S-2Q`.
    pub name: String,
}

/// What a VF can create now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    /// The types the VF can create now, as listed in `creatable_vgpu_types`.
    pub entries: Vec<CatalogEntry>,
    /// Malformed lines that were skipped (trimmed, at most 200 characters each).
    pub skipped: Vec<String>,
}

impl Catalog {
    /// The entry whose canonical name matches the requested profile (case-insensitive).
    pub fn find(&self, profile: &str) -> Option<&CatalogEntry> {
        self.entries.iter().find(|e| gpuvisor_sdk::profile_matches(profile, &e.name))
    }
}

/// Parses the text of `creatable_vgpu_types`. Never fails; see the module docs.
pub fn parse_creatable_vgpu_types(text: &str) -> Catalog {
    let mut cat = Catalog::default();
    for raw in text.split('\n') {
        let line = raw.trim_end_matches('\r').trim();
        if line.is_empty() {
            continue;
        }
        let first = line.split(|c: char| c.is_whitespace() || c == ':').next().unwrap_or("");
        if first.eq_ignore_ascii_case("id") {
            continue;
        }
        let (id, name) = match line.split_once(':') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => match line.split_once(char::is_whitespace) {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (line, ""),
            },
        };
        let digits_only = !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit());
        // A name that is the vendor word alone (`1148 : NVIDIA`) names no profile.
        let profile = gpuvisor_sdk::canonical_profile(name);
        let named = !profile.is_empty() && !profile.eq_ignore_ascii_case(VENDOR_WORD);
        match (id.parse::<u32>(), named) {
            (Ok(n), true) if digits_only && n != 0 => cat.entries.push(CatalogEntry { id: n, name: name.to_string() }),
            _ => cat.skipped.push(line.chars().take(200).collect()),
        }
    }
    cat
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(c: &Catalog) -> Vec<(u32, &str)> {
        c.entries.iter().map(|e| (e.id, e.name.as_str())).collect()
    }

    #[test]
    fn the_driver_format_parses() {
        let c = parse_creatable_vgpu_types("ID    : vGPU Name\n1147  : NVIDIA L40S-1Q\n1148  : NVIDIA L40S-2Q\n");
        assert_eq!(ids(&c), vec![(1147, "NVIDIA L40S-1Q"), (1148, "NVIDIA L40S-2Q")]);
        assert!(c.skipped.is_empty());
    }

    #[test]
    fn crlf_blank_lines_and_header_case_are_tolerated() {
        let c = parse_creatable_vgpu_types("id : vgpu name\r\n\r\n1159 : NVIDIA L40S-48Q\r\n\n");
        assert_eq!(ids(&c), vec![(1159, "NVIDIA L40S-48Q")]);
    }

    #[test]
    fn whitespace_separated_entries_and_wide_ids_parse() {
        let c = parse_creatable_vgpu_types("1147 NVIDIA L40S-1Q\n4294967295 : Huge\n00012 : Zero padded\n");
        assert_eq!(ids(&c), vec![(1147, "NVIDIA L40S-1Q"), (4294967295, "Huge"), (12, "Zero padded")]);
    }

    #[test]
    fn empty_file_and_header_alone_mean_nothing_creatable() {
        assert!(parse_creatable_vgpu_types("").entries.is_empty());
        let c = parse_creatable_vgpu_types("ID    : vGPU Name\n");
        assert!(c.entries.is_empty());
        assert!(c.skipped.is_empty());
    }

    #[test]
    fn garbage_lines_are_skipped_and_counted_not_fatal() {
        let text = "ID : vGPU Name\nxyz : bad id\n-5 : negative\n99999999999 : too big\n1150 :\n1150\n\u{0}\u{1}\n1148 : NVIDIA L40S-2Q\n";
        let c = parse_creatable_vgpu_types(text);
        assert_eq!(ids(&c), vec![(1148, "NVIDIA L40S-2Q")]);
        assert_eq!(c.skipped.len(), 6);
    }

    /// Issue 18 finding 6: a line whose name is the vendor word alone, or that has no id,
    /// is skipped (and so reported with its VF), never a profile called `NVIDIA`.
    #[test]
    fn a_name_that_is_the_vendor_word_alone_or_a_line_without_an_id_is_skipped() {
        let c = parse_creatable_vgpu_types(
            "ID : vGPU Name\n1148 : NVIDIA\nNVIDIA\n1149 :   nvidia  \n1150 : NVIDIA L40S-4Q\n",
        );
        assert_eq!(ids(&c), vec![(1150, "NVIDIA L40S-4Q")]);
        assert_eq!(c.skipped, vec!["1148 : NVIDIA".to_string(), "NVIDIA".to_string(), "1149 :   nvidia".to_string()]);
    }

    #[test]
    fn id_zero_is_never_a_type() {
        let c = parse_creatable_vgpu_types(
            "ID : vGPU Name\n0 : NVIDIA L40S-2Q\n0000 : NVIDIA L40S-4Q\n1148 : NVIDIA L40S-2Q\n",
        );
        assert_eq!(ids(&c), vec![(1148, "NVIDIA L40S-2Q")]);
        assert_eq!(c.skipped, vec!["0 : NVIDIA L40S-2Q".to_string(), "0000 : NVIDIA L40S-4Q".to_string()]);
    }

    #[test]
    fn binary_garbage_never_panics() {
        let junk: String = (0..2000u32).map(|i| char::from_u32((i * 7919) % 0x2FF).unwrap_or('x')).collect();
        let _ = parse_creatable_vgpu_types(&junk);
    }

    #[test]
    fn find_matches_the_canonical_name_case_insensitively() {
        let c = parse_creatable_vgpu_types("1148  : NVIDIA L40S-2Q\n");
        assert_eq!(c.find("l40s-2q").map(|e| e.id), Some(1148));
        assert_eq!(c.find("NVIDIA L40S-2Q").map(|e| e.id), Some(1148));
        assert!(c.find("L40S-4Q").is_none());
    }
}
