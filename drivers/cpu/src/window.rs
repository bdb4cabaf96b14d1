//! When a fusion window pays on this CPU ([`WindowThresholds`]).
//!
//! A launch costs the host about what a fused kernel's does, and the window itself
//! about as much again, so fusing must save memory traffic to pay:
//!
//! * a chain with private intermediates saves their trips to memory from about 32K
//!   work-items on;
//! * a chain that keeps its intermediates in global memory saves only the trips the
//!   caches would not have saved: measured, it pays once its first kernel's input and
//!   output outgrow about twice the core's L2 cache (512 KiB on the development VM,
//!   2 MiB on the H100 machine's Xeon).
//!
//! Figures: `docs/PERFORMANCE.md`, "Fusion windows that do not pay".

use gantry_driver::fusion::WindowThresholds;

/// Work-items from which a window's chain pays to fuse.
const MIN_ITEMS: u64 = 32_768;

/// The L2 size assumed where the system does not say.
const DEFAULT_L2: u64 = 512 << 10;

/// The thresholds for this machine, from its L2 cache's size.
pub(crate) fn thresholds() -> WindowThresholds {
    thresholds_for(l2_bytes().unwrap_or(DEFAULT_L2))
}

/// The size of the first CPU's level-2 data or unified cache, as Linux describes it
/// (`/sys/devices/system/cpu/cpu0/cache/index*/{level,type,size}`).
fn l2_bytes() -> Option<u64> {
    let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    caches.flatten().find_map(|entry| {
        let read = |name: &str| std::fs::read_to_string(entry.path().join(name)).ok();
        let level2 = read("level")?.trim() == "2";
        let data = matches!(read("type")?.trim(), "Unified" | "Data");
        if level2 && data {
            cache_bytes(&read("size")?)
        } else {
            None
        }
    })
}

fn thresholds_for(l2: u64) -> WindowThresholds {
    WindowThresholds { min_items: MIN_ITEMS, min_global_bytes: 2 * l2 }
}

/// A cache size as Linux writes it (`512K`, `2048K`, `32M`).
fn cache_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    digits.parse::<u64>().ok().filter(|&n| n > 0).map(|n| n * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_linux_writes_them() {
        assert_eq!(cache_bytes("512K\n"), Some(512 << 10));
        assert_eq!(cache_bytes("2048K"), Some(2 << 20));
        assert_eq!(cache_bytes("32M"), Some(32 << 20));
        assert_eq!(cache_bytes("65536"), Some(65536));
        for bad in ["", "K", "0K", "12Q", "-1K"] {
            assert_eq!(cache_bytes(bad), None, "{bad:?}");
        }
    }

    /// Global intermediates pay past twice the L2; the item threshold does not move.
    #[test]
    fn the_global_threshold_follows_the_l2() {
        let vm = thresholds_for(512 << 10);
        let xeon = thresholds_for(2 << 20);
        assert_eq!((vm.min_items, xeon.min_items), (MIN_ITEMS, MIN_ITEMS));
        assert_eq!((vm.min_global_bytes, xeon.min_global_bytes), (1 << 20, 4 << 20));
        // A K = 2 chain of 256K f32 elements: its first kernel touches 2 MiB.
        assert!(vm.judge(1 << 18, 2 << 20, false).is_none());
        assert!(xeon.judge(1 << 18, 2 << 20, false).is_some());
        let t = thresholds();
        assert!(t.min_global_bytes >= 2 << 10 && t.min_items == MIN_ITEMS, "{t:?}");
        // Where Linux describes the caches, the L2 is found (the development VM's and
        // the H100 machine's are).
        if std::path::Path::new("/sys/devices/system/cpu/cpu0/cache/index2/level").exists() {
            assert!(l2_bytes().is_some_and(|b| b >= 64 << 10), "{:?}", l2_bytes());
        }
    }
}
