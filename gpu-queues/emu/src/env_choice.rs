//! The software controller's `GPUNVME_EMU_*` settings (declared in `gpunvme_settings`, read
//! through it): one parser for every variable that names one of a few choices, so that each
//! fails the same way.

use gpu_queues::GpuError;

/// The choice variable `name` (holding `value`, trimmed) names among `choices`: `None` when it
/// is unset or empty (the caller's default applies), else the named choice, or an
/// `InvalidArgument` that lists every accepted word.
pub(crate) fn choice<T: Copy>(
    name: &str,
    value: Option<&str>,
    choices: &[(&str, T)],
) -> Result<Option<T>, GpuError> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    if let Some(&(_, c)) = choices.iter().find(|(word, _)| *word == v) {
        return Ok(Some(c));
    }
    let words: Vec<String> = choices.iter().map(|(w, _)| format!("`{w}`")).collect();
    Err(GpuError::InvalidArgument(format!(
        "{name}={v}: expected {}",
        words.join(" or ")
    )))
}

#[cfg(test)]
mod tests {
    use super::choice;

    #[test]
    fn unset_empty_named_and_unknown_values() {
        let c = [("a", 1), ("b", 2)];
        assert_eq!(choice("V", None, &c).unwrap(), None);
        assert_eq!(choice("V", Some("  "), &c).unwrap(), None);
        assert_eq!(choice("V", Some(" b "), &c).unwrap(), Some(2));
        let e = choice("V", Some("z"), &c).unwrap_err().to_string();
        assert!(e.contains("V=z: expected `a` or `b`"), "{e}");
    }
}
