//! A scripted driver and a world builder for the stage unit tests.

use std::sync::Arc;
use std::time::Instant;

use bevy_ecs::entity::Entity;
use bevy_ecs::world::World;
use gantry_components::{
    BufferCore, ByteRange, CommandDesc, CommandKind, Device, Devices, Edges, EventShared, Inbox, Mailbox,
    Message, QueueCore, Requirement, SchedulerConfig, Work,
};
use gantry_driver::sync::channel::{unbounded, Sender};
use gantry_driver::sync::Mutex;
use gantry_driver::{
    Accepted, AccessMode, AllocId, Capabilities, Completion, DeviceInfo, DeviceKind, Driver, ExecError,
    HostStorage, MemSpace, OpId, Submission,
};

/// A driver that records submissions and completes them only when told to.
pub struct Scripted {
    pub info: DeviceInfo,
    pub submitted: Mutex<Vec<(OpId, Vec<u64>)>>,
    pub done: Sender<Completion>,
    next_alloc: Mutex<u64>,
}

impl Driver for Scripted {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn alloc(&self, _bytes: usize) -> Result<AllocId, ExecError> {
        let mut n = self.next_alloc.lock();
        *n += 1;
        Ok(AllocId(*n))
    }
    fn free(&self, _id: AllocId) {}
    fn submit(&self, sub: Submission<'_>) -> Result<Accepted, ExecError> {
        let waits = sub.waits.iter().map(|h| *h.downcast_ref::<u64>().unwrap()).collect();
        self.submitted.lock().push((sub.id, waits));
        Ok(Accepted::Pending(Arc::new(sub.id.0)))
    }
}

impl Scripted {
    pub fn complete(&self, e: Entity, result: Result<(), ExecError>) {
        self.done
            .send(Completion { op: OpId(e.to_bits()), result, started_ns: 1, ended_ns: 2, lane: 0 })
            .unwrap();
    }
    pub fn submitted_entities(&self) -> Vec<Entity> {
        self.submitted.lock().iter().map(|(id, _)| Entity::from_bits(id.0)).collect()
    }
    pub fn waits_of(&self, e: Entity) -> Vec<Entity> {
        let s = self.submitted.lock();
        let (_, w) = s.iter().find(|(id, _)| id.0 == e.to_bits()).expect("submitted");
        w.iter().map(|&b| Entity::from_bits(b)).collect()
    }
}

/// A scheduler world with device 0 = a host-memory scripted driver and device 1 = a
/// scripted driver with its own memory.
pub struct Harness {
    pub world: World,
    pub stages: crate::Stages,
    pub tx: Arc<Mailbox>,
    pub host: Arc<Scripted>,
    pub dev: Arc<Scripted>,
    pub queue: Arc<QueueCore>,
}

fn scripted(
    name: &str,
    shares_host_memory: bool,
    in_driver_waits: bool,
    done: Sender<Completion>,
) -> Arc<Scripted> {
    Arc::new(Scripted {
        info: DeviceInfo {
            name: name.into(),
            kind: DeviceKind::Sim,
            caps: Capabilities {
                shares_host_memory,
                in_driver_waits,
                image_kinds: &[gantry_driver::ImageKind::Closure],
                host_tasks: true,
                records_host_tasks: false,
                max_local_memory: 0,
                max_private_memory: 0,
                virtual_time: false,
                peer_group: 0,
                fusion_window: gantry_driver::fusion::WindowThresholds::ALWAYS,
            },
        },
        submitted: Mutex::new(Vec::new()),
        done,
        next_alloc: Mutex::new(0),
    })
}

impl Harness {
    pub fn new(in_driver_waits: bool) -> Self {
        let tx = Arc::new(Mailbox::new());
        let (done_tx, done_rx) = unbounded();
        let host = scripted("host", true, in_driver_waits, done_tx.clone());
        let dev = scripted("dev", false, in_driver_waits, done_tx);
        let device = |d: &Arc<Scripted>, space| Device {
            driver: d.clone(),
            info: d.info.clone(),
            space,
            lost: Default::default(),
        };
        let devices = Devices(vec![device(&host, MemSpace::Host), device(&dev, MemSpace::Device(1))]);
        let config = SchedulerConfig {
            preserve_on_failure: false,
            clock: gantry_driver::Clock { epoch: Instant::now(), profiling: true },
            ingest_limit: usize::MAX,
        };
        let mut world = crate::scheduler_world(
            devices,
            Inbox { messages: tx.clone(), completions: done_rx, hand_back: None },
            config,
        );
        let queue = Arc::new(QueueCore { id: 1, device: 0, in_order: false, entity: Default::default() });
        let stages = crate::Stages::new(&mut world);
        Self { world, stages, tx, host, dev, queue }
    }

    pub fn flush(&mut self) {
        self.stages.run(&mut self.world);
    }

    pub fn buffer(&self, bytes: usize) -> Arc<BufferCore> {
        Arc::new(BufferCore {
            id: bytes as u64,
            storage: Arc::new(HostStorage::zeroed(bytes)),
            bytes,
            record: Default::default(),
            dropped: Default::default(),
            promotion: Default::default(),
            recorded: Default::default(),
        })
    }

    /// Submits a command using `reqs` (buffer, mode, byte range) on `device` through
    /// `queue`, waiting on `waits`; returns its event.
    pub fn submit_on(
        &self,
        queue: &Arc<QueueCore>,
        device: u32,
        kind: CommandKind,
        reqs: &[(&Arc<BufferCore>, AccessMode, std::ops::Range<usize>)],
        waits: &[&Arc<EventShared>],
    ) -> Arc<EventShared> {
        let event = Arc::new(EventShared::new("cmd".into(), 0, 0));
        let requirements = reqs
            .iter()
            .map(|(b, m, r)| Requirement::new((*b).clone(), *m, ByteRange { start: r.start, end: r.end }))
            .collect();
        let work =
            if kind == CommandKind::Barrier { Work::Marker } else { Work::Fill([0u8].into_iter().collect()) };
        let desc = CommandDesc {
            kind,
            name: "cmd".into(),
            queue: queue.clone(),
            device,
            requirements,
            work,
            waits: waits.iter().map(|w| (*w).clone()).collect(),
            event: event.clone(),
            fusion: None,
        };
        self.tx.post(Message::Submit(desc));
        event
    }

    pub fn submit(
        &self,
        reqs: &[(&Arc<BufferCore>, AccessMode, std::ops::Range<usize>)],
    ) -> Arc<EventShared> {
        self.submit_on(&self.queue, 0, CommandKind::Fill, reqs, &[])
    }

    pub fn preds(&self, ev: &EventShared) -> Vec<Entity> {
        let e = ev.command.get().expect("live command");
        let mut p = self.world.get::<Edges>(e).expect("edges").preds.to_vec();
        p.sort();
        p
    }
}

pub fn entity(ev: &EventShared) -> Entity {
    ev.command.get().expect("live command")
}
