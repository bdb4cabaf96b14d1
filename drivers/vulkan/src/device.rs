//! An open Vulkan device: the logical device on the chosen physical device, its
//! compute queue and, where the device has a transfer-only family and the driver
//! uses it, a transfer queue (each shared by every submission, behind a lock, as
//! Vulkan requires),
//! the limits the driver checks work against, and a one-shot path for the few
//! commands that must finish before a call returns (zeroing a new allocation).

use std::ffi::CStr;
use std::sync::{Arc, Mutex};

use ash::vk;
use gantry_driver::ExecError;

use crate::error::{CallError, Check};
use crate::families::{QueueFamilies, TransferQueue};
use crate::probe::{self, Select};

/// What the driver reads from the device once, when it opens it.
#[derive(Clone, Debug)]
pub struct Limits {
    /// `maxComputeSharedMemorySize`: the most work-group memory a shader may declare.
    pub max_shared: usize,
    /// `maxComputeWorkGroupSize`.
    pub max_group: [u32; 3],
    /// `maxComputeWorkGroupInvocations`.
    pub max_invocations: u32,
    /// `maxComputeWorkGroupCount`.
    pub max_groups: [u32; 3],
    /// `maxPushConstantsSize`: the most scalar bytes a kernel may take.
    pub max_push: u32,
    /// `minStorageBufferOffsetAlignment`: where a kernel argument's range may start.
    pub storage_align: u64,
    /// `maxStorageBufferRange`: the longest range a kernel argument may have.
    pub max_storage_range: u64,
    /// `shaderDenormPreserveFloat32`: shaders may keep `f32` denormals (WGSL
    /// kernels then do, `crate::exact`).
    pub denorm_preserve_f32: bool,
}

/// The logical device and what goes with it. Dropped last (after every object made
/// from it).
pub(crate) struct Device {
    pub name: Arc<str>,
    /// The device's name as the driver reports it (`llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub device_name: String,
    pub limits: Limits,
    pub raw: ash::Device,
    pub push: ash::khr::push_descriptor::Device,
    /// Queue 0 of the compute family.
    pub queue: Mutex<vk::Queue>,
    /// Storage-buffer descriptors may be updated after their set is bound
    /// (`descriptorBindingStorageBufferUpdateAfterBind`, enabled where supported):
    /// only then may a recorded command buffer be pointed at other buffers by
    /// rewriting its sets, since otherwise an update invalidates every command buffer
    /// that bound the set (drivers may copy descriptors into the commands).
    pub update_after_bind: bool,
    /// Queue 0 of the transfer family, where one is used.
    pub transfer_queue: Option<Mutex<vk::Queue>>,
    /// The families of the two queues; buffers are shared between them
    /// ([`QueueFamilies::sharing`]).
    pub families: QueueFamilies,
    memory: vk::PhysicalDeviceMemoryProperties,
    one_shot: Mutex<OneShot>,
    instance: ash::Instance,
    _entry: ash::Entry,
}

/// A command pool and fence for commands the caller waits for.
struct OneShot {
    pool: vk::CommandPool,
    fence: vk::Fence,
}

impl Device {
    /// Opens the device `select` names.
    pub(crate) fn open(
        select: Select,
        transfer: TransferQueue,
        name: Arc<str>,
    ) -> Result<Arc<Self>, ExecError> {
        let found = probe::open(select, transfer, &name)?;
        let families = found.families;
        let fail = |e: CallError| e.into_exec(&name, "opening the device");
        let priorities = [1.0f32];
        let queues: Vec<vk::DeviceQueueCreateInfo> = families
            .sharing()
            .into_iter()
            .map(|f| vk::DeviceQueueCreateInfo::default().queue_family_index(f).queue_priorities(&priorities))
            .collect();
        let extensions = [ash::khr::push_descriptor::NAME.as_ptr()];
        let mut supported = vk::PhysicalDeviceVulkan12Features::default();
        let mut features2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut supported);
        // SAFETY: a valid physical device of this instance (Vulkan 1.2, checked by the probe).
        unsafe { found.instance.get_physical_device_features2(found.physical, &mut features2) };
        let update_after_bind = supported.descriptor_binding_storage_buffer_update_after_bind == vk::TRUE;
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default()
            .timeline_semaphore(true)
            .descriptor_binding_storage_buffer_update_after_bind(update_after_bind);
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&extensions)
            .push_next(&mut v12);
        // SAFETY: a valid physical device with this queue family and extension.
        let raw = match unsafe { found.instance.create_device(found.physical, &info, None) }
            .call("vkCreateDevice")
        {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: no child objects.
                unsafe { found.instance.destroy_instance(None) };
                return Err(fail(e));
            }
        };
        // SAFETY (both): family and index exist (created above).
        let queue = unsafe { raw.get_device_queue(families.compute, 0) };
        let transfer_queue = families.transfer.map(|f| Mutex::new(unsafe { raw.get_device_queue(f, 0) }));
        let push = ash::khr::push_descriptor::Device::new(&found.instance, &raw);
        let l = &found.props.limits;
        let mut v12_props = vk::PhysicalDeviceVulkan12Properties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut v12_props);
        // SAFETY: a valid physical device of this instance (Vulkan 1.2, checked by the probe).
        unsafe { found.instance.get_physical_device_properties2(found.physical, &mut props2) };
        let denorm_preserve_f32 = v12_props.shader_denorm_preserve_float32 == vk::TRUE;
        let limits = Limits {
            max_shared: l.max_compute_shared_memory_size as usize,
            max_group: l.max_compute_work_group_size,
            max_invocations: l.max_compute_work_group_invocations,
            max_groups: l.max_compute_work_group_count,
            max_push: l.max_push_constants_size,
            storage_align: l.min_storage_buffer_offset_alignment.max(1),
            max_storage_range: l.max_storage_buffer_range as u64,
            denorm_preserve_f32,
        };
        // SAFETY: a NUL-terminated array from the driver.
        let device_name =
            unsafe { CStr::from_ptr(found.props.device_name.as_ptr()) }.to_string_lossy().into_owned();
        let one_shot = match OneShot::new(&raw, families.compute) {
            Ok(o) => o,
            Err(e) => {
                // SAFETY: no other child objects.
                unsafe {
                    raw.destroy_device(None);
                    found.instance.destroy_instance(None);
                }
                return Err(fail(e));
            }
        };
        Ok(Arc::new(Self {
            name,
            device_name,
            limits,
            raw,
            push,
            queue: Mutex::new(queue),
            update_after_bind,
            transfer_queue,
            families,
            memory: found.memory,
            one_shot: Mutex::new(one_shot),
            instance: found.instance,
            _entry: found.entry,
        }))
    }

    /// A memory type allowed by `bits` with all of `want`, or with `fallback` where
    /// none has `want`.
    pub(crate) fn memory_type(
        &self,
        bits: u32,
        want: vk::MemoryPropertyFlags,
        fallback: vk::MemoryPropertyFlags,
    ) -> Option<u32> {
        let types = &self.memory.memory_types[..self.memory.memory_type_count as usize];
        let find = |flags: vk::MemoryPropertyFlags| {
            types
                .iter()
                .enumerate()
                .position(|(i, t)| bits & (1 << i) != 0 && t.property_flags.contains(flags))
        };
        find(want).or_else(|| find(fallback)).map(|i| i as u32)
    }

    /// The size of the heap memory type `index` lies in.
    pub(crate) fn heap_size(&self, index: u32) -> u64 {
        let heap = self.memory.memory_types[index as usize].heap_index;
        self.memory.memory_heaps[heap as usize].size
    }

    /// Records commands with `record`, submits them and waits until they ran.
    pub(crate) fn run_now(&self, record: impl FnOnce(vk::CommandBuffer)) -> Result<(), CallError> {
        let one = crate::execution::lock(&self.one_shot);
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(one.pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: the pool is this device's and locked.
        let cmd = unsafe { self.raw.allocate_command_buffers(&alloc) }.call("vkAllocateCommandBuffers")?[0];
        let result = (|| {
            let begin =
                vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: a fresh command buffer of the locked pool.
            unsafe { self.raw.begin_command_buffer(cmd, &begin) }.call("vkBeginCommandBuffer")?;
            record(cmd);
            // SAFETY: recording, as above.
            unsafe { self.raw.end_command_buffer(cmd) }.call("vkEndCommandBuffer")?;
            let cmds = [cmd];
            let submit = [vk::SubmitInfo::default().command_buffers(&cmds)];
            {
                let queue = crate::execution::lock(&self.queue);
                // SAFETY: the queue is locked; the fence is unsignalled.
                unsafe { self.raw.queue_submit(*queue, &submit, one.fence) }.call("vkQueueSubmit")?;
            }
            // SAFETY: the fence was just submitted.
            unsafe { self.raw.wait_for_fences(&[one.fence], true, u64::MAX) }.call("vkWaitForFences")?;
            // SAFETY: signalled, no longer in use.
            unsafe { self.raw.reset_fences(&[one.fence]) }.call("vkResetFences")
        })();
        // SAFETY: finished (or never submitted); the pool is locked.
        unsafe { self.raw.free_command_buffers(one.pool, &[cmd]) };
        result
    }
}

impl OneShot {
    fn new(raw: &ash::Device, family: u32) -> Result<Self, CallError> {
        let info = vk::CommandPoolCreateInfo::default().queue_family_index(family);
        // SAFETY: a live device and one of its families.
        let pool = unsafe { raw.create_command_pool(&info, None) }.call("vkCreateCommandPool")?;
        // SAFETY: a live device.
        let fence = unsafe { raw.create_fence(&vk::FenceCreateInfo::default(), None) }.call("vkCreateFence");
        match fence {
            Ok(fence) => Ok(Self { pool, fence }),
            Err(e) => {
                // SAFETY: created above, unused.
                unsafe { raw.destroy_command_pool(pool, None) };
                Err(e)
            }
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let one = self.one_shot.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the last holder: every object made from the device is gone (they
        // hold it), and idle waits for anything still queued.
        unsafe {
            let _ = self.raw.device_wait_idle();
            self.raw.destroy_fence(one.fence, None);
            self.raw.destroy_command_pool(one.pool, None);
            self.raw.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}
