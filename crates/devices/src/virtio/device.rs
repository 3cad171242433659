//! A virtio device as the device manager holds it, whatever its kind: its transport drives it
//! ([`VirtioDevice`]), its thread serves it (`MutEventSubscriber`), and a snapshot keeps its
//! state ([`Persist`], tagged with its kind as [`VirtioKindState`]). Every virtio device is
//! one through the blanket implementation below: a new device implements `VirtioDevice` and
//! `Persist` beside its own code, and adds its state's variant in [`crate::state`].

use crate::persist::Persist;
use crate::state::VirtioKindState;
use crate::virtio::VirtioDevice;

/// A virtio device the device manager can wire, pause, save and describe without knowing its
/// kind.
pub trait Device: VirtioDevice {
    /// Its state as a snapshot keeps it: [`Persist::save`], tagged with its kind.
    fn save_kind(&self) -> VirtioKindState;
}

impl<D> Device for D
where
    D: VirtioDevice + Persist,
    D::State: Into<VirtioKindState>,
{
    fn save_kind(&self) -> VirtioKindState {
        self.save().into()
    }
}
