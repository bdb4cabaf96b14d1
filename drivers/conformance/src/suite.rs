//! The [`suite!`](crate::suite!) macro and what its tests call.

use std::io::Write;
use std::sync::Arc;

use gantry_driver::sync::channel::unbounded;
use gantry_driver::{Driver, DriverContext, ExecError};

use crate::harness::Factory;

/// What a suite's factory returns: a driver, or, for a backend that cannot start on
/// this machine (no driver library, no device), why not.
pub trait MadeDriver {
    /// The driver, or why there is none.
    fn made(self) -> Result<Arc<dyn Driver>, ExecError>;
}

impl MadeDriver for Arc<dyn Driver> {
    fn made(self) -> Result<Arc<dyn Driver>, ExecError> {
        Ok(self)
    }
}

impl MadeDriver for Result<Arc<dyn Driver>, ExecError> {
    fn made(self) -> Result<Arc<dyn Driver>, ExecError> {
        self
    }
}

/// Makes the driver under test, or says why it cannot here.
pub type MakeDriver = dyn Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError>;

/// What a check found, when it did not panic.
#[must_use]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The driver passed it.
    Checked,
    /// It does not apply to the driver, for this reason (a capability it lacks, an
    /// operation it refuses as unsupported).
    Skipped(String),
}

impl Outcome {
    /// A skip for `reason`.
    pub fn skipped(reason: impl Into<String>) -> Self {
        Outcome::Skipped(reason.into())
    }
}

/// Runs one check of a suite: what each test [`suite!`](crate::suite!) generates calls.
///
/// `checks` are the names of every check of the suite. With `skips` (`Some`), the
/// checks named there must skip and every other one must run: a driver that stops
/// offering something, or starts offering it, fails the suite until the list says
/// so. Without (`None`), a skip is printed with its reason and passes.
///
/// A driver that `make` cannot make on this machine (its factory's error: no
/// driver library, no device) skips the check, whatever `skips` says, and says so on
/// standard error past the test harness's capture, so that a run without the device
/// reads as skipped, not as checked. Otherwise the driver made to find that out lives
/// until the check ends (a GPU backend then keeps its device's context between the
/// drivers the check makes).
///
/// # Panics
/// When the check fails, when `skips` names something that is not a check, or when
/// the outcome differs from what `skips` expects.
pub fn run_check(
    name: &str,
    check: fn(&Factory) -> Outcome,
    make: &MakeDriver,
    checks: &[&str],
    skips: Option<&[&str]>,
) {
    if let Some(unknown) = skips.into_iter().flatten().find(|s| !checks.contains(s)) {
        panic!("the suite's skips name `{unknown}`, which is not a check (checks: {checks:?})");
    }
    let (tx, _rx) = unbounded();
    let probe = match make(DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) })
    {
        Ok(driver) => driver,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "`{name}` skipped: the driver is unavailable on this machine: {e}"
            );
            return;
        }
    };
    let factory = |ctx: DriverContext| -> Arc<dyn Driver> {
        make(ctx).unwrap_or_else(|e| panic!("the driver's factory failed after it had made a driver: {e}"))
    };
    let outcome = check(&factory);
    drop(probe);
    let expected_skip = skips.map(|s| s.contains(&name));
    match (outcome, expected_skip) {
        (Outcome::Checked, Some(true)) => {
            panic!("`{name}` ran and passed, but the suite lists it under skips: remove it from the list")
        }
        (Outcome::Skipped(reason), Some(false)) => panic!(
            "`{name}` was skipped ({reason}), but the suite expects it to run: \
             list it under skips, or restore what the driver stopped offering"
        ),
        (Outcome::Skipped(reason), _) => eprintln!("`{name}` skipped: {reason}"),
        (Outcome::Checked, _) => {}
    }
}

/// Expands to a module `$name` of `#[test]` functions, one per check of
/// [`checks`](crate::checks), each running that check on drivers made by `$factory`
/// (an expression callable as `Fn(DriverContext) -> Arc<dyn Driver>`, usually a
/// closure, or as a `DriverFactory`, `Fn(DriverContext) -> Result<Arc<dyn Driver>,
/// ExecError>`, whose error skips every check: see [`run_check`]; the module sees
/// the items of the one it is invoked in).
///
/// ```
/// use std::sync::Arc;
/// use gantry_conformance::{Driver, DriverContext};
/// // Skips are printed with their reason:
/// gantry_conformance::suite!(cpu, |ctx: DriverContext| -> Arc<dyn Driver> {
///     Arc::new(gantry_cpu::CpuDriver::new(Default::default(), ctx))
/// });
/// // Or every skip is declared, and any other outcome fails:
/// gantry_conformance::suite!(
///     cpu_strict,
///     |ctx: DriverContext| -> Arc<dyn Driver> { Arc::new(gantry_cpu::CpuDriver::new(Default::default(), ctx)) },
///     skips = [allocation_limits],
/// );
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! suite {
    ($name:ident, $factory:expr, skips = [$($skip:ident),* $(,)?] $(,)?) => {
        $crate::__suite_module!(
            $name,
            $factory,
            ::core::option::Option::Some(&[$(::core::stringify!($skip)),*])
        );
    };
    ($name:ident, $factory:expr $(,)?) => {
        $crate::__suite_module!($name, $factory, ::core::option::Option::None);
    };
}

/// The checks of [`suite!`]: the one list of them.
#[doc(hidden)]
#[macro_export]
macro_rules! __suite_module {
    (@tests $name:ident, $factory:expr, $skips:expr; $($check:ident),* $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn factory(
                ctx: $crate::DriverContext,
            ) -> ::core::result::Result<::std::sync::Arc<dyn $crate::Driver>, $crate::ExecError> {
                $crate::MadeDriver::made(($factory)(ctx))
            }

            const CHECKS: &[&str] = &[$(::core::stringify!($check)),*];
            const SKIPS: ::core::option::Option<&[&str]> = $skips;

            $(
                #[test]
                fn $check() {
                    $crate::run_check(
                        ::core::stringify!($check),
                        $crate::checks::$check,
                        &factory,
                        CHECKS,
                        SKIPS,
                    )
                }
            )*
        }
    };
    ($name:ident, $factory:expr, $skips:expr) => {
        $crate::__suite_module!(@tests $name, $factory, $skips;
            wait_list_order,
            dependent_chain,
            independent_ops_complete_once,
            kernel_panic_is_reported,
            dependency_failure_propagates,
            failure_preserves_written_ranges,
            copy_round_trip,
            copy_within_device_memory,
            fill_patterns,
            fill_length_mismatch,
            malformed_ops_are_errors,
            allocation_limits,
            host_task_runs_once,
            host_task_panic_is_reported,
            command_buffer_replay,
            command_buffer_patch,
        );
    };
}
