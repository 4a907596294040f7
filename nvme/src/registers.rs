//! Typed access to the controller registers (NVMe Base 2.0, section 3.1.3) over a
//! [`RegisterIo`] window, and bounded waits on CSTS.

#![forbid(unsafe_code)]

use crate::device::RegisterIo;
use crate::error::Error;
use crate::timeout::Backoff;
use nvme_spec::registers as reg;
use nvme_spec::{Aqa, Cap, Cc, Csts, Vs};
use std::time::{Duration, Instant};

/// Typed view of a controller's register window.
#[derive(Clone, Copy)]
pub struct Registers<'a> {
    io: &'a dyn RegisterIo,
}

impl<'a> Registers<'a> {
    /// Wraps a register window.
    pub fn new(io: &'a dyn RegisterIo) -> Self {
        Self { io }
    }

    /// The underlying window.
    pub fn io(&self) -> &'a dyn RegisterIo {
        self.io
    }

    /// Reads CAP; all ones means the device is gone.
    pub fn cap(&self) -> Result<Cap, Error> {
        let v = self.io.read_u64(reg::CAP);
        if v == u64::MAX {
            return Err(Error::DeviceGone);
        }
        Ok(Cap::from(v))
    }

    /// Reads VS.
    pub fn vs(&self) -> Result<Vs, Error> {
        let v = self.io.read_u32(reg::VS);
        if v == u32::MAX {
            return Err(Error::DeviceGone);
        }
        Ok(Vs::from(v))
    }

    /// Reads CC.
    pub fn cc(&self) -> Result<Cc, Error> {
        let v = self.io.read_u32(reg::CC);
        if v == u32::MAX {
            return Err(Error::DeviceGone);
        }
        Ok(Cc::from(v))
    }

    /// Writes CC.
    pub fn set_cc(&self, cc: Cc) {
        self.io.write_u32(reg::CC, cc.into())
    }

    /// Reads CSTS; all ones means the device is gone.
    pub fn csts(&self) -> Result<Csts, Error> {
        let v = self.io.read_u32(reg::CSTS);
        if v == u32::MAX {
            return Err(Error::DeviceGone);
        }
        Ok(Csts::from(v))
    }

    /// Reads CSTS and turns fatal conditions into errors: all ones → [`Error::DeviceGone`],
    /// CFS → [`Error::ControllerFatal`].
    pub fn check_fatal(&self) -> Result<Csts, Error> {
        let csts = self.csts()?;
        if csts.cfs() {
            return Err(Error::ControllerFatal { csts: csts.into() });
        }
        Ok(csts)
    }

    /// Writes AQA.
    pub fn set_aqa(&self, aqa: Aqa) {
        self.io.write_u32(reg::AQA, aqa.into())
    }

    /// Writes ASQ (admin submission queue base, 4 KiB aligned).
    pub fn set_asq(&self, addr: u64) {
        self.io.write_u64(reg::ASQ, addr)
    }

    /// Writes ACQ (admin completion queue base, 4 KiB aligned).
    pub fn set_acq(&self, addr: u64) {
        self.io.write_u64(reg::ACQ, addr)
    }

    /// Polls CSTS until `done(csts)` holds or `timeout` passes. Returns the last CSTS read and
    /// whether the condition was met. An all-ones read ends the wait with
    /// [`Error::DeviceGone`].
    pub fn wait_csts(
        &self,
        timeout: Duration,
        mut done: impl FnMut(Csts) -> bool,
    ) -> Result<(Csts, bool), Error> {
        let start = Instant::now();
        let mut backoff = Backoff::for_registers();
        loop {
            let csts = self.csts()?;
            if done(csts) {
                return Ok((csts, true));
            }
            if start.elapsed() >= timeout {
                return Ok((csts, false));
            }
            backoff.snooze();
        }
    }
}
