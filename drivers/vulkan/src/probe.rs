//! Finding Vulkan: the loader (`libvulkan`, opened at run time), an instance, and
//! the physical device and queue families a driver uses. Every way this can fail on
//! a machine without Vulkan is a typed [`ExecError::Unsupported`] naming the reason,
//! never a panic.

use std::ffi::CStr;
use std::sync::Arc;

use ash::vk;
use gantry_driver::ExecError;

use crate::error::{CallError, Check};
use crate::families::{choose_families, QueueFamilies, TransferQueue};

/// Which physical device a driver opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Select {
    /// The `n`th physical device the instance enumerates (it must have a compute
    /// queue).
    Index(usize),
    /// The first physical device with a compute queue.
    FirstWithCompute,
}

/// What [`open`] found: the loader, the instance and the chosen device's properties.
pub(crate) struct Found {
    pub entry: ash::Entry,
    pub instance: ash::Instance,
    pub physical: vk::PhysicalDevice,
    pub props: vk::PhysicalDeviceProperties,
    pub memory: vk::PhysicalDeviceMemoryProperties,
    /// The compute family and the transfer-only one, where used.
    pub families: QueueFamilies,
}

/// The error of a machine where Vulkan cannot be used, for `reason`.
fn unavailable(device: &Arc<str>, reason: &'static str) -> ExecError {
    ExecError::Unsupported { device: device.clone(), what: reason }
}

/// Loads the loader, creates an instance and picks the device `select` names.
pub(crate) fn open(select: Select, transfer: TransferQueue, device: &Arc<str>) -> Result<Found, ExecError> {
    // SAFETY: loading the system's Vulkan loader runs its initializers, which is
    // what every Vulkan application does; no other library is touched.
    let entry = unsafe { ash::Entry::load() }
        .map_err(|_| unavailable(device, "Vulkan (no Vulkan loader: libvulkan.so.1 not found)"))?;
    let app = vk::ApplicationInfo::default()
        .application_name(c"gantry")
        .engine_name(c"gantry")
        .api_version(vk::API_VERSION_1_2);
    let info = vk::InstanceCreateInfo::default().application_info(&app);
    // SAFETY: a valid create info with no extensions or layers.
    let instance = match unsafe { entry.create_instance(&info, None) } {
        Ok(i) => i,
        Err(vk::Result::ERROR_INCOMPATIBLE_DRIVER) => {
            return Err(unavailable(
                device,
                "Vulkan (no driver: the loader found no installable client driver)",
            ))
        }
        Err(code) => {
            return Err(CallError { call: "vkCreateInstance", code }.into_exec(device, "creating an instance"))
        }
    };
    match pick(&instance, select, transfer, device) {
        Ok((physical, props, memory, families)) => {
            Ok(Found { entry, instance, physical, props, memory, families })
        }
        Err(e) => {
            // SAFETY: created above, no child objects.
            unsafe { instance.destroy_instance(None) };
            Err(e)
        }
    }
}

type Picked =
    (vk::PhysicalDevice, vk::PhysicalDeviceProperties, vk::PhysicalDeviceMemoryProperties, QueueFamilies);

fn pick(
    instance: &ash::Instance,
    select: Select,
    transfer: TransferQueue,
    device: &Arc<str>,
) -> Result<Picked, ExecError> {
    // SAFETY: a live instance.
    let all = unsafe { instance.enumerate_physical_devices() }
        .call("vkEnumeratePhysicalDevices")
        .map_err(|e| e.into_exec(device, "listing physical devices"))?;
    if all.is_empty() {
        return Err(unavailable(device, "Vulkan (no physical device)"));
    }
    let candidates: Vec<vk::PhysicalDevice> = match select {
        Select::Index(i) => match all.get(i) {
            Some(&p) => vec![p],
            None => return Err(unavailable(device, "Vulkan (no physical device with this index)")),
        },
        Select::FirstWithCompute => all,
    };
    for physical in candidates {
        // SAFETY: a physical device of this instance.
        let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
        let Some(chosen) = choose_families(&families, transfer) else { continue };
        // SAFETY: as above.
        let (props, memory) = unsafe {
            (
                instance.get_physical_device_properties(physical),
                instance.get_physical_device_memory_properties(physical),
            )
        };
        if props.api_version < vk::API_VERSION_1_2 {
            return Err(unavailable(
                device,
                "Vulkan (the device is older than Vulkan 1.2: no timeline semaphores)",
            ));
        }
        if !has_extension(instance, physical, ash::khr::push_descriptor::NAME) {
            return Err(unavailable(device, "Vulkan (the device lacks VK_KHR_push_descriptor)"));
        }
        return Ok((physical, props, memory, chosen));
    }
    Err(unavailable(device, "Vulkan (no physical device with a compute queue)"))
}

fn has_extension(instance: &ash::Instance, physical: vk::PhysicalDevice, name: &CStr) -> bool {
    // SAFETY: a physical device of this instance.
    let Ok(exts) = (unsafe { instance.enumerate_device_extension_properties(physical) }) else {
        return false;
    };
    exts.iter().any(|e| e.extension_name_as_c_str() == Ok(name))
}

/// How many physical devices this process sees, or why it sees none.
///
/// ```
/// // On a machine without a Vulkan loader this is a typed error, never a panic.
/// match gantry_vulkan::device_count() {
///     Ok(n) => println!("{n} Vulkan devices"),
///     Err(e) => println!("no Vulkan: {e}"),
/// }
/// ```
pub fn device_count() -> Result<usize, ExecError> {
    let device: Arc<str> = "vulkan".into();
    // SAFETY: as in `open`.
    let entry = unsafe { ash::Entry::load() }
        .map_err(|_| unavailable(&device, "Vulkan (no Vulkan loader: libvulkan.so.1 not found)"))?;
    let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_2);
    // SAFETY: a valid create info.
    let instance = match unsafe {
        entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None)
    } {
        Ok(i) => i,
        Err(vk::Result::ERROR_INCOMPATIBLE_DRIVER) => return Ok(0),
        Err(code) => {
            return Err(
                CallError { call: "vkCreateInstance", code }.into_exec(&device, "creating an instance")
            )
        }
    };
    // SAFETY: a live instance, destroyed once after.
    let n = unsafe { instance.enumerate_physical_devices() }.map(|d| d.len());
    // SAFETY: no child objects.
    unsafe { instance.destroy_instance(None) };
    n.call("vkEnumeratePhysicalDevices").map_err(|e| e.into_exec(&device, "listing physical devices"))
}
