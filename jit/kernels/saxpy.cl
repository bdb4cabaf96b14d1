// Compiled to bitcode by build.rs (the build-time route): the test
// `build_time_bitcode_runs` includes it and runs it without clang.
kernel void saxpy(global const float* x, global float* y, float a) {
    size_t i = get_global_id(0);
    y[i] = a * x[i] + y[i];
}
