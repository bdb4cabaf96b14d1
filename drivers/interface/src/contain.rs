//! User closures whose destructors may panic.
//!
//! A kernel's or host task's closure is dropped wherever its last owner lets go of
//! it: on the scheduler's thread when a command retires or fails before running, on a
//! driver thread after a host task. A captured value whose destructor panics must not
//! unwind through those (a panic out of a scheduler system stops the scheduler; one
//! out of a rayon job aborts the process). [`Contained`] drops its closure inside
//! `catch_unwind`; what it caught is reported through `tracing` and kept for the
//! thread, so a driver that drops a host task's closure right after running it turns
//! the panic into that task's error ([`take_drop_panic`]).

use std::cell::RefCell;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A value whose drop never unwinds. Derefs to the value, and has its layout, so a
/// pointer to it is a pointer to the value.
#[repr(transparent)]
pub struct Contained<F>(ManuallyDrop<F>);

impl<F> Contained<F> {
    /// Wraps `value`.
    pub fn new(value: F) -> Self {
        Self(ManuallyDrop::new(value))
    }
}

impl<F> std::ops::Deref for Contained<F> {
    type Target = F;
    fn deref(&self) -> &F {
        &self.0
    }
}

impl<F> std::ops::DerefMut for Contained<F> {
    fn deref_mut(&mut self) -> &mut F {
        &mut self.0
    }
}

thread_local! {
    /// The last destructor panic [`Contained`] caught on this thread.
    static DROP_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

impl<F> Drop for Contained<F> {
    fn drop(&mut self) {
        // SAFETY: dropped once, here; the field is never used again.
        let dropped = catch_unwind(AssertUnwindSafe(|| unsafe { ManuallyDrop::drop(&mut self.0) }));
        if let Err(payload) = dropped {
            let message = crate::panic_message(&*payload);
            tracing::error!(
                "a value captured by a kernel or host task panicked in its destructor: {message}"
            );
            DROP_PANIC.with(|p| *p.borrow_mut() = Some(message));
        }
    }
}

/// The destructor panic [`Contained`] last caught on this thread, if any, taken.
pub fn take_drop_panic() -> Option<String> {
    DROP_PANIC.with(|p| p.borrow_mut().take())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("bomb");
        }
    }

    #[test]
    fn a_panicking_destructor_is_caught_and_kept_for_the_thread() {
        let _ = take_drop_panic();
        let bomb = Bomb;
        let closure = Contained::new(move || {
            let _ = &bomb;
        });
        closure();
        drop(closure);
        assert_eq!(take_drop_panic().as_deref(), Some("bomb"));
        assert_eq!(take_drop_panic(), None);
    }

    #[test]
    fn an_ordinary_value_drops_once() {
        let counted = std::sync::Arc::new(());
        let c = counted.clone();
        drop(Contained::new(c));
        assert_eq!(std::sync::Arc::strong_count(&counted), 1);
        assert_eq!(take_drop_panic(), None);
    }
}
