kernel void saxpy(global const float* x, global float* y, uint n, float a) {
    size_t i = get_global_id(0);
    if (i < n) y[i] = a * x[i] + y[i];
}
kernel void group_sums(global const int* in, global int* out, local int* tmp) {
    size_t l = get_local_id(0);
    tmp[l] = in[get_global_id(0)];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (size_t s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (l < s) tmp[l] += tmp[l + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (l == 0) out[get_group_id(0)] = tmp[0];
}
kernel void axpb(global float* x, uint n, float a, float b) {
    size_t i = get_global_id(0);
    if (i < n) x[i] = a * x[i] + b;
}
#pragma OPENCL FP_CONTRACT OFF
kernel void step(global const float* in, global float* out, uint n, float a, float b) {
    size_t i = get_global_id(0);
    if (i < n) out[i] = a * in[i] + b;
}
kernel void clamp_sqrt(global float* x, uint n) {
    size_t i = get_global_id(0);
    if (i < n) x[i] = sqrt(fmax(fabs(x[i]), 0.25f));
}
