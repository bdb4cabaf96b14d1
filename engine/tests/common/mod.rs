//! Helpers shared by the integration tests.

/// Silences the panics a test causes on purpose (`intended` says which, by their
/// message); anything else, a failed assertion, still prints.
pub fn quiet_panics(intended: fn(&str) -> bool) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        if !intended(&msg) {
            default(info);
        }
    }));
}
