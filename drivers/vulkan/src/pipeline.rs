//! Compute pipelines: each kernel image is loaded once per driver (through
//! [`ImageCache`](gantry_driver::ImageCache)) into its descriptor set layouts (one
//! storage buffer per global argument: one layout pushed with
//! `VK_KHR_push_descriptor`, for launches one by one, and one of allocated sets, for
//! recorded command buffers), a pipeline layout for each (plus a push-constant block
//! for the scalars) and its shader; pipelines are made on first use per workgroup
//! size (one, unless the shader's size is set per launch) and binding model
//! ([`Bind`]: a pipeline is tied to its layout, and the two layouts are not
//! compatible), and kept with the image.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ash::vk;
use gantry_driver::{
    no_image, CodeImage, ExecError, Geometry, ImageCache, ImageKind, KernelRef, ScratchKind, Signature,
};
use smallvec::SmallVec;

use crate::device::Device;
use crate::error::{CallError, Check};
use crate::execution::lock;
use crate::launch::{self, Shape};
use crate::spirv::{self, Dim};
use crate::wgsl::{CompileError, Wgsl};

/// How many pipelines a driver made and how long that took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Pipelines made (one per image and workgroup size).
    pub created: u64,
    /// Nanoseconds spent making them: WGSL compiled to SPIR-V for its size, the
    /// shader module and `vkCreateComputePipelines`.
    pub nanos: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    created: AtomicU64,
    nanos: AtomicU64,
}

impl Counters {
    pub(crate) fn get(&self) -> PipelineStats {
        PipelineStats {
            created: self.created.load(Ordering::Relaxed),
            nanos: self.nanos.load(Ordering::Relaxed),
        }
    }
}

/// Why an image could not be loaded.
#[derive(Debug)]
pub(crate) enum LoadError {
    /// It does not compile, or is malformed.
    Compile(CompileError),
    /// A Vulkan call failed.
    Call(CallError),
}

impl From<CompileError> for LoadError {
    fn from(e: CompileError) -> Self {
        LoadError::Compile(e)
    }
}
impl From<CallError> for LoadError {
    fn from(e: CallError) -> Self {
        LoadError::Call(e)
    }
}

enum Source {
    /// Compiled to SPIR-V per workgroup size.
    Wgsl(Box<Wgsl>),
    /// One shader module, specialized per workgroup size.
    SpirV(vk::ShaderModule),
}

/// How a pipeline's buffers are bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Bind {
    /// Pushed descriptors (`vkCmdPushDescriptorSetKHR`): launches one by one, whose
    /// command buffers hold no descriptor sets of their own.
    Push,
    /// Allocated descriptor sets (`vkCmdBindDescriptorSets`): recorded command
    /// buffers, which write each set once and can rewrite it without recording.
    Sets,
}

/// A loaded image: its layouts, its shader, and its pipelines by workgroup size.
pub(crate) struct Pipelines {
    source: Source,
    entry: CString,
    /// Each workgroup dimension (Vulkan order): fixed, or set by the launch (a
    /// WGSL override, or a SPIR-V specialization constant of this id).
    pub dims: [Dim; 3],
    /// The set layouts and pipeline layouts, by [`Bind`] (`Push`, `Sets`).
    set_layouts: [vk::DescriptorSetLayout; 2],
    layouts: [vk::PipelineLayout; 2],
    /// Global arguments the layout binds.
    pub globals: usize,
    /// Bytes of the push-constant block (the scalars, rounded up to 4).
    pub push_bytes: u32,
    variants: Mutex<HashMap<([u32; 3], Bind), vk::Pipeline>>,
    counters: Arc<Counters>,
    dev: Arc<Device>,
}

// SAFETY: Vulkan handles are usable from any thread; the naga module is plain data
// read under `&self` only.
unsafe impl Send for Pipelines {}
// SAFETY: see above; the variants are behind a lock.
unsafe impl Sync for Pipelines {}

impl Pipelines {
    /// Loads `image` (SPIR-V or WGSL) for kernels of `signature`.
    pub(crate) fn load(
        dev: &Arc<Device>,
        image: &CodeImage,
        signature: &Signature,
        counters: &Arc<Counters>,
    ) -> Result<Self, LoadError> {
        let entry =
            CString::new(image.entry()).map_err(|_| CompileError::NoEntry(image.entry().to_owned()))?;
        let (source, dims) = match image.kind() {
            ImageKind::Wgsl => {
                let text = std::str::from_utf8(image.code())
                    .map_err(|e| CompileError::Parse(format!("not UTF-8: {e}")))?;
                let w = Wgsl::parse(text, image.entry())?;
                w.check_interface(signature.globals.len(), signature.scalar_bytes())?;
                let over = w.overridable();
                let dims =
                    [0, 1, 2].map(|d| if over[d] { Dim::Spec(d as u32) } else { Dim::Fixed(w.size[d]) });
                (Source::Wgsl(Box::new(w)), dims)
            }
            _ => {
                let words = spirv::words(image.code())?;
                let dims = spirv::workgroup_size(&words, image.entry())?;
                let info = vk::ShaderModuleCreateInfo::default().code(&words);
                // SAFETY: a live device; the words are a SPIR-V module (checked
                // for its header; the driver validates the rest).
                let module =
                    unsafe { dev.raw.create_shader_module(&info, None) }.call("vkCreateShaderModule")?;
                (Source::SpirV(module), dims)
            }
        };
        let globals = signature.globals.len();
        let bindings: Vec<vk::DescriptorSetLayoutBinding> = (0..globals as u32)
            .map(|i| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let destroy_source = |source: &Source| {
            if let Source::SpirV(m) = source {
                // SAFETY: made above, unused.
                unsafe { dev.raw.destroy_shader_module(*m, None) };
            }
        };
        let push_bytes = (signature.scalar_bytes() as u32).next_multiple_of(4);
        let made = Self::layouts(dev, &bindings, push_bytes);
        let (set_layouts, layouts) = match made {
            Ok(l) => l,
            Err(e) => {
                destroy_source(&source);
                return Err(e.into());
            }
        };
        Ok(Self {
            source,
            entry,
            dims,
            set_layouts,
            layouts,
            globals,
            push_bytes,
            variants: Mutex::new(HashMap::new()),
            counters: counters.clone(),
            dev: dev.clone(),
        })
    }

    /// The set layouts and pipeline layouts for `bindings`, in [`Bind`] order, each
    /// with a push-constant range of `push_bytes` (none where zero); nothing is left
    /// made on failure.
    fn layouts(
        dev: &Arc<Device>,
        bindings: &[vk::DescriptorSetLayoutBinding],
        push_bytes: u32,
    ) -> Result<([vk::DescriptorSetLayout; 2], [vk::PipelineLayout; 2]), CallError> {
        let mut set_layouts = Vec::with_capacity(2);
        let mut layouts = Vec::with_capacity(2);
        let ranges = [vk::PushConstantRange {
            stage_flags: vk::ShaderStageFlags::COMPUTE,
            offset: 0,
            size: push_bytes,
        }];
        // Sets of recorded command buffers are rewritten to rebind them (see
        // `Device::update_after_bind`); pushed descriptors never are.
        let after_bind = vec![vk::DescriptorBindingFlags::UPDATE_AFTER_BIND; bindings.len()];
        let sets_flags = if dev.update_after_bind {
            vk::DescriptorSetLayoutCreateFlags::UPDATE_AFTER_BIND_POOL
        } else {
            vk::DescriptorSetLayoutCreateFlags::empty()
        };
        let made = (|| {
            for flags in [vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR, sets_flags] {
                let mut binding_flags =
                    vk::DescriptorSetLayoutBindingFlagsCreateInfo::default().binding_flags(&after_bind);
                let mut info = vk::DescriptorSetLayoutCreateInfo::default().flags(flags).bindings(bindings);
                if flags.contains(vk::DescriptorSetLayoutCreateFlags::UPDATE_AFTER_BIND_POOL) {
                    info = info.push_next(&mut binding_flags);
                }
                // SAFETY: a valid create info.
                let set_layout = unsafe { dev.raw.create_descriptor_set_layout(&info, None) }
                    .call("vkCreateDescriptorSetLayout")?;
                set_layouts.push(set_layout);
                let sets = [set_layout];
                let info = vk::PipelineLayoutCreateInfo::default()
                    .set_layouts(&sets)
                    .push_constant_ranges(if push_bytes > 0 { &ranges } else { &[] });
                // SAFETY: a valid create info.
                layouts.push(
                    unsafe { dev.raw.create_pipeline_layout(&info, None) }.call("vkCreatePipelineLayout")?,
                );
            }
            Ok(())
        })();
        match made {
            Ok(()) => Ok(([set_layouts[0], set_layouts[1]], [layouts[0], layouts[1]])),
            Err(e) => {
                // SAFETY: made above, unused.
                unsafe {
                    layouts.iter().for_each(|&l| dev.raw.destroy_pipeline_layout(l, None));
                    set_layouts.iter().for_each(|&l| dev.raw.destroy_descriptor_set_layout(l, None));
                }
                Err(e)
            }
        }
    }

    /// The pipeline layout of binding model `bind`.
    pub(crate) fn layout(&self, bind: Bind) -> vk::PipelineLayout {
        self.layouts[bind as usize]
    }

    /// The descriptor set layout of binding model `bind`.
    pub(crate) fn set_layout(&self, bind: Bind) -> vk::DescriptorSetLayout {
        self.set_layouts[bind as usize]
    }

    /// The pipeline for workgroup size `size` (Vulkan order) and binding model
    /// `bind`, made on first use.
    pub(crate) fn pipeline(&self, size: [u32; 3], bind: Bind) -> Result<vk::Pipeline, LoadError> {
        if let Some(&p) = lock(&self.variants).get(&(size, bind)) {
            return Ok(p);
        }
        let start = Instant::now();
        let dev = &self.dev.raw;
        let (module, temporary) = match &self.source {
            Source::SpirV(m) => (*m, false),
            Source::Wgsl(w) => {
                let words = w.spirv(size, self.dev.limits.denorm_preserve_f32)?;
                let info = vk::ShaderModuleCreateInfo::default().code(&words);
                // SAFETY: naga's validated SPIR-V on a live device.
                (unsafe { dev.create_shader_module(&info, None) }.call("vkCreateShaderModule")?, true)
            }
        };
        // SPIR-V images take their launch-set dimensions as specialization
        // constants; WGSL ones were compiled for the size.
        let mut entries = Vec::new();
        if !temporary {
            for (d, dim) in self.dims.iter().enumerate() {
                if let Dim::Spec(id) = dim {
                    entries.push(vk::SpecializationMapEntry {
                        constant_id: *id,
                        offset: 4 * d as u32,
                        size: 4,
                    });
                }
            }
        }
        let data: Vec<u8> = size.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let spec = vk::SpecializationInfo::default().map_entries(&entries).data(&data);
        let mut stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(&self.entry);
        if !entries.is_empty() {
            stage = stage.specialization_info(&spec);
        }
        let info = [vk::ComputePipelineCreateInfo::default().stage(stage).layout(self.layout(bind))];
        // SAFETY: a valid create info on a live device.
        let made = unsafe { dev.create_compute_pipelines(vk::PipelineCache::null(), &info, None) };
        if temporary {
            // SAFETY: a pipeline does not need its module once made.
            unsafe { dev.destroy_shader_module(module, None) };
        }
        let pipeline = made.map_err(|(_, code)| CallError { call: "vkCreateComputePipelines", code })?[0];
        self.counters.created.fetch_add(1, Ordering::Relaxed);
        self.counters.nanos.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let mut variants = lock(&self.variants);
        if let Some(&p) = variants.get(&(size, bind)) {
            // Another thread made it first.
            // SAFETY: made above, never used.
            unsafe { dev.destroy_pipeline(pipeline, None) };
            return Ok(p);
        }
        variants.insert((size, bind), pipeline);
        Ok(pipeline)
    }
}

impl Drop for Pipelines {
    fn drop(&mut self) {
        // SAFETY: every operation that used these holds the image's `Arc` until it
        // completes, so none is in use; each is destroyed once.
        unsafe {
            for (_, p) in self.variants.get_mut().unwrap_or_else(|p| p.into_inner()).drain() {
                self.dev.raw.destroy_pipeline(p, None);
            }
            for (&l, &s) in self.layouts.iter().zip(&self.set_layouts) {
                self.dev.raw.destroy_pipeline_layout(l, None);
                self.dev.raw.destroy_descriptor_set_layout(s, None);
            }
            if let Source::SpirV(m) = self.source {
                self.dev.raw.destroy_shader_module(m, None);
            }
        }
    }
}

/// The driver's loaded images, shared with its command-buffer recorder.
pub(crate) struct Images {
    cache: ImageCache<Pipelines>,
    pub(crate) counters: Arc<Counters>,
    dev: Arc<Device>,
}

/// A kernel ready to dispatch: its loaded image, the pipeline for its workgroup
/// size and binding model, its pipeline layout, and its shape.
#[derive(Clone)]
pub(crate) struct Ready {
    pub pipelines: Arc<Pipelines>,
    pub pipeline: vk::Pipeline,
    pub layout: vk::PipelineLayout,
    pub shape: Shape,
}

impl Images {
    pub(crate) fn new(dev: &Arc<Device>) -> Self {
        Self { cache: ImageCache::default(), counters: Arc::default(), dev: dev.clone() }
    }

    pub(crate) fn len(&self) -> usize {
        self.cache.len()
    }

    fn invalid(&self, message: String) -> ExecError {
        crate::error::invalid(&self.dev.name, message)
    }

    /// `kernel` loaded (its SPIR-V image preferred over its WGSL one) and made
    /// ready for a launch over `geometry` binding its buffers by `bind`; the error
    /// names the kernel.
    pub(crate) fn ready(
        &self,
        kernel: &KernelRef,
        geometry: &Geometry,
        bind: Bind,
    ) -> Result<Ready, ExecError> {
        let name = &kernel.name;
        let signature = &kernel.signature;
        let limits = &self.dev.limits;
        if geometry.offset() != [0; 3] {
            return Err(ExecError::Unsupported {
                device: self.dev.name.clone(),
                what: "global offsets in Vulkan kernel launches",
            });
        }
        let local = signature.memory_bytes(ScratchKind::Local);
        if local > limits.max_shared {
            return Err(self.invalid(format!(
                "kernel `{name}` declares {local} bytes of local memory; the device has {} \
                 (maxComputeSharedMemorySize)",
                limits.max_shared
            )));
        }
        if signature.scalar_bytes() > limits.max_push as usize {
            return Err(self.invalid(format!(
                "kernel `{name}` takes {} bytes of scalars; the device's push constants hold {}",
                signature.scalar_bytes(),
                limits.max_push
            )));
        }
        let image = kernel
            .image(ImageKind::SpirV)
            .or_else(|| kernel.image(ImageKind::Wgsl))
            .ok_or_else(|| no_image(&self.dev.name, name))?;
        let kind = image.kind();
        let load_error = |e: LoadError| match e {
            LoadError::Compile(e) => {
                self.invalid(format!("the {kind} image of kernel `{name}` does not load: {e}"))
            }
            LoadError::Call(e) => {
                e.into_exec(&self.dev.name, format!("loading the {kind} image of kernel `{name}`"))
            }
        };
        let pipelines = self
            .cache
            .get_or_load(image, |i| Pipelines::load(&self.dev, i, signature, &self.counters))
            .map_err(load_error)?;
        if pipelines.globals != signature.globals.len()
            || pipelines.push_bytes as usize != signature.scalar_bytes().next_multiple_of(4)
        {
            return Err(self.invalid(format!(
                "kernel `{name}` ({} buffer slots, {} bytes of scalars) shares its image with a kernel of another \
                 signature ({} slots, {} bytes)",
                signature.globals.len(),
                signature.scalar_bytes(),
                pipelines.globals,
                pipelines.push_bytes
            )));
        }
        let shape = launch::shape(geometry, &pipelines.dims, limits)
            .map_err(|e| self.invalid(format!("kernel `{name}`: {e}")))?;
        let pipeline = pipelines.pipeline(shape.size, bind).map_err(load_error)?;
        let layout = pipelines.layout(bind);
        Ok(Ready { pipelines, pipeline, layout, shape })
    }
}

/// Records a dispatch of `ready` over `args` (buffer, offset, length: checked and
/// aligned) with `scalars` into `cmd`. `bound` is the pipeline the command buffer
/// has bound (a dispatch of the same pipeline does not bind it again).
pub(crate) fn record_dispatch(
    dev: &Device,
    cmd: vk::CommandBuffer,
    ready: &Ready,
    args: &[(vk::Buffer, usize, usize)],
    scalars: &[u8],
    bound: &mut vk::Pipeline,
) {
    let infos: SmallVec<[[vk::DescriptorBufferInfo; 1]; 8]> = args
        .iter()
        .map(|&(buffer, offset, len)| {
            let range = if len == 0 { vk::WHOLE_SIZE } else { len as u64 };
            [vk::DescriptorBufferInfo { buffer, offset: offset as u64, range }]
        })
        .collect();
    let writes: SmallVec<[vk::WriteDescriptorSet; 8]> = infos
        .iter()
        .enumerate()
        .map(|(i, info)| {
            vk::WriteDescriptorSet::default()
                .dst_binding(i as u32)
                .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                .buffer_info(info)
        })
        .collect();
    let mut push: SmallVec<[u8; 64]> = SmallVec::from_slice(scalars);
    push.resize(ready.pipelines.push_bytes as usize, 0);
    let layout = ready.layout;
    let groups = ready.shape.groups;
    // SAFETY: a recording command buffer; the pipeline and layout are the image's
    // (the caller keeps them with the work); the descriptors name live buffers over
    // checked, aligned ranges; the push constants fill the layout's range.
    unsafe {
        if *bound != ready.pipeline {
            dev.raw.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, ready.pipeline);
            *bound = ready.pipeline;
        }
        if !writes.is_empty() {
            dev.push.cmd_push_descriptor_set(cmd, vk::PipelineBindPoint::COMPUTE, layout, 0, &writes);
        }
        if !push.is_empty() {
            dev.raw.cmd_push_constants(cmd, layout, vk::ShaderStageFlags::COMPUTE, 0, &push);
        }
        dev.raw.cmd_dispatch(cmd, groups[0], groups[1], groups[2]);
    }
}
