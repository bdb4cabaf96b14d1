//! Proves the build-time route in this crate's own tests: `kernels/saxpy.cl` is
//! compiled to `$OUT_DIR/saxpy.bc` with `gantry-jit-clang`, as an application's
//! build script would. Without clang the bitcode is not made and the test that
//! uses it is compiled out (cfg `gantry_jit_no_prebuilt`), so building the crate
//! never needs clang.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(gantry_jit_no_prebuilt)");
    let found =
        std::process::Command::new(gantry_jit_clang::clang_binary()).arg("--version").output().is_ok();
    if !found || gantry_jit_clang::build_script::compile("kernels/saxpy.cl", "saxpy.bc").is_err() {
        println!("cargo::rustc-cfg=gantry_jit_no_prebuilt");
    }
}
