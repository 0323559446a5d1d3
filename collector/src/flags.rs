//! How the `NAME=PATH` flags (`--volume`, `--data`) are read: one rule for the name, one for the
//! path.

use std::path::PathBuf;

/// `NAME=REST` of a `--volume` or `--data` flag (`what`): a name of letters, digits, `_` and `-`
/// that `valid` accepts in the series it makes, and the rest after `=`, trimmed.
pub(crate) fn named<'t>(
    text: &'t str,
    what: &str,
    valid: impl Fn(&str) -> bool,
) -> Result<(&'t str, &'t str), String> {
    let (name, rest) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not NAME=PATH"))?;
    let name = name.trim();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(format!(
            "{what} name {name:?} may only hold letters, digits, `_` and `-`"
        ));
    }
    if !valid(name) {
        return Err(format!(
            "{what} name {name:?} does not make a valid metric name"
        ));
    }
    Ok((name, rest.trim()))
}

/// `path` as a path, refused unless absolute.
pub(crate) fn absolute(what: &str, path: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(path);
    if !path.is_absolute() {
        return Err(format!("{what} path {:?} must be absolute", path.display()));
    }
    Ok(path)
}
