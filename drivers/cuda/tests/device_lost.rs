//! A fault inside a kernel is sticky: the context is unusable. The driver reports the
//! fault once, as the backend's error, fails what waited on it with a dependency
//! error, and everything after with `DeviceLost`. Its own test binary, because the
//! fault poisons the process's context for the device.

mod common;

use common::{gpu, kernel, scalars};
use gantry_driver::AccessMode::Write;
use gantry_driver::{DeviceOp, Driver, ExecError, Geometry, ImageKind, Range, Signature};
use smallvec::SmallVec;

const TRAP_C: &str = r#"
extern "C" __global__ void trap(unsigned int* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 1;
    if (i == 0) asm volatile("trap;");
}
"#;

#[test]
fn a_fault_marks_the_device_lost() {
    let Some(mut g) = gpu("a_fault_marks_the_device_lost") else { return };
    let n = 1024usize;
    let x = g.alloc(n * 4);
    let sig = Signature::new().global(Write).scalar::<u32>();
    let trap = kernel("trap", sig, ImageKind::CudaC, "trap", TRAP_C);
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let (h, faulting) = g.submit(g.launch(&trap, geometry, &[(x, n * 4)], scalars(&[n as u32])), &[]);
    let fill = DeviceOp::Fill { dst: common::whole(x, n * 4), pattern: SmallVec::from_slice(&[7]) };
    let (_, dependent) = g.submit(fill, &[h]);
    let cause = match g.result(faulting) {
        Err(e @ ExecError::Backend { .. }) => e,
        other => panic!("a trapping kernel: {other:?}"),
    };
    eprintln!("the fault: {cause}");
    match g.result(dependent) {
        Err(ExecError::DependencyFailed { cause: c, .. }) => assert_eq!(c.root_cause(), &cause),
        other => panic!("the fill waiting on the faulting kernel: {other:?}"),
    }
    let later = DeviceOp::Fill { dst: common::whole(x, n * 4), pattern: SmallVec::from_slice(&[8]) };
    let (_, later) = g.submit(later, &[]);
    assert!(matches!(g.result(later), Err(ExecError::DeviceLost { .. })), "after the fault");
    assert!(matches!(g.driver.alloc(64), Err(ExecError::DeviceLost { .. })));
}
