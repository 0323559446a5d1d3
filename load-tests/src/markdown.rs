//! Markdown output: reports are meant to be pasted into BENCHMARKS.md as they are.

use std::fmt::Write as _;

/// A table whose numeric columns are right-aligned.
pub(crate) struct Table {
    columns: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Align {
    Left,
    Right,
}

impl Table {
    pub(crate) fn new(columns: &[(&str, Align)]) -> Table {
        Table {
            columns: columns
                .iter()
                .map(|(name, align)| (name.to_string(), *align))
                .collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.columns.len(), "one cell per column");
        self.rows.push(cells);
    }

    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let header: Vec<&str> = self.columns.iter().map(|(name, _)| name.as_str()).collect();
        let _ = writeln!(out, "| {} |", header.join(" | "));
        let rule: Vec<&str> = self
            .columns
            .iter()
            .map(|(_, align)| {
                if *align == Align::Right {
                    "---:"
                } else {
                    "---"
                }
            })
            .collect();
        let _ = writeln!(out, "|{}|", rule.join("|"));
        for row in &self.rows {
            let cells: Vec<String> = row.iter().map(|c| c.replace('|', "\\|")).collect();
            let _ = writeln!(out, "| {} |", cells.join(" | "));
        }
        out
    }
}

/// The exact command line as a shell would accept it again, quoting only where needed.
pub fn shell_words(args: impl IntoIterator<Item = String>) -> String {
    args.into_iter()
        .map(|arg| {
            let plain = !arg.is_empty()
                && arg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
            if plain {
                arg
            } else {
                format!("'{}'", arg.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A fenced code block holding `command`.
pub(crate) fn command_block(command: &str) -> String {
    format!("```sh\n{command}\n```\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_right_align_numeric_columns_and_escape_pipes() {
        let mut table = Table::new(&[("target", Align::Left), ("p50 ms", Align::Right)]);
        table.row(vec!["a|b".into(), "1.00".into()]);
        assert_eq!(
            table.render(),
            "| target | p50 ms |\n|---|---:|\n| a\\|b | 1.00 |\n"
        );
    }

    #[test]
    fn the_command_line_is_quoted_only_where_a_shell_needs_it() {
        let args = [
            "mlscope-bench",
            "passthrough",
            "--rates",
            "20,50",
            "--proxy-arg",
            "a b",
            "it's",
        ]
        .map(String::from);
        assert_eq!(
            shell_words(args),
            r"mlscope-bench passthrough --rates 20,50 --proxy-arg 'a b' 'it'\''s'"
        );
    }
}
