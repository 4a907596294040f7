//! Register window, enable/disable/shutdown handshakes and Controller Fatal Status.

mod common;

use common::*;
use nvme::Device;
use nvme_emu::EmuConfig;
use nvme_spec::registers::{ASQ, CAP, CC, CSTS, VS};
use nvme_spec::{AdminOpcode, Cap, Cc, Command, Csts};

#[test]
fn cap_and_version() {
    let h = Host::new(EmuConfig {
        mqes: 255,
        ..EmuConfig::default()
    });
    let cap = Cap::from(h.regs().read_u64(CAP));
    assert_eq!(cap.mqes_z(), 255);
    assert!(cap.cqr());
    assert_eq!(cap.to(), 2);
    assert_eq!(cap.dstrd(), 0);
    assert_eq!(cap.css(), Cap::CSS_NVM);
    assert_eq!((cap.mpsmin(), cap.mpsmax()), (0, 0));
    assert!(!cap.nssrs());
    assert_eq!(h.regs().read_u32(VS), 0x0001_0400);
    assert!(h.regs().len() >= 0x4000);
    // Read-only registers ignore writes.
    h.regs().write_u64(CAP, 0);
    h.regs().write_u32(CSTS, 0xffff_ffff);
    assert_eq!(Cap::from(h.regs().read_u64(CAP)).mqes_z(), 255);
    assert_eq!(h.csts().into_bits(), 0);
    assert!(h.dev.describe().contains("64 MiB in memory"));
}

#[test]
fn enable_disable_and_reenable() {
    let mut h = Host::new(EmuConfig::default());
    assert!(!h.csts().rdy());
    h.enable();
    assert_eq!(h.regs().read_u32(CC), Host::good_cc().into_bits());
    let (c, _) = h.identify(1, 0);
    assert_ok(&c);
    h.disable();
    let stats = h.dev.stats();
    assert!(stats.resets >= 1);
    // After a reset the admin queue starts over from slot 0 with phase 1.
    h.enable();
    let (c, _) = h.identify(1, 0);
    assert_ok(&c);
    assert_eq!(c.sqhd, 1);
}

#[test]
fn shutdown_notification_completes() {
    let mut h = Host::enabled(EmuConfig::default());
    h.regs()
        .write_u32(CC, Host::good_cc().with_shn(Cc::SHN_NORMAL).into_bits());
    assert!(h.wait_csts(|c| c.shst() == Csts::SHST_COMPLETE));
    h.disable();
    assert_eq!(h.csts().shst(), Csts::SHST_NORMAL);
}

#[test]
fn invalid_enable_settings_are_fatal() {
    let cases: [(&str, Cc); 4] = [
        ("MPS 8 KiB", Host::good_cc().with_mps(1)),
        ("CSS admin only", Host::good_cc().with_css(0b111)),
        ("IOSQES 7", Host::good_cc().with_iosqes(7)),
        ("AMS WRR", Host::good_cc().with_ams(1)),
    ];
    let mut h = Host::new(EmuConfig::default());
    for (what, cc) in cases {
        h.write_enable(cc);
        assert!(h.wait_csts(|c| c.cfs()), "{what}: no CFS");
        assert!(!h.csts().rdy(), "{what}: ready anyway");
        h.disable();
    }
    // An unaligned admin queue base.
    h.write_enable(Host::good_cc());
    h.disable();
    let asq = h.admin.sq.device_address(0);
    h.regs().write_u64(ASQ, asq + 64);
    h.regs().write_u32(CC, Host::good_cc().into_bits());
    assert!(h.wait_csts(|c| c.cfs()));
    h.disable();
    // And then a good enable works.
    h.enable();
    let (c, _) = h.identify(1, 0);
    assert_ok(&c);
}

#[test]
fn unmapped_admin_queue_is_fatal() {
    let mut h = Host::new(EmuConfig::default());
    h.write_enable(Host::good_cc());
    assert!(h.wait_csts(|c| c.rdy()));
    h.disable();
    // Point ACQ at memory that was freed: the first completion write is a DMA error.
    let gone = h.dev.alloc_dma(4096).unwrap();
    let addr = gone.device_address(0);
    drop(gone);
    h.regs().write_u64(nvme_spec::registers::ACQ, addr);
    h.regs().write_u32(nvme_spec::registers::AQA, 0x001f_001f);
    h.regs().write_u64(ASQ, h.admin.sq.device_address(0));
    h.regs().write_u32(CC, Host::good_cc().into_bits());
    assert!(h.wait_csts(|c| c.rdy()));
    h.admin
        .submit(&h.dev, &Command::new(AdminOpcode::IDENTIFY.0, 1, 0));
    assert!(
        h.wait_csts(|c| c.cfs()),
        "CQE write to unmapped memory must be fatal"
    );
    assert!(h.dev.stats().fatal_errors >= 1);
}

#[test]
fn injected_fatal_stops_processing_until_reset() {
    let mut h = Host::enabled(EmuConfig::default());
    h.dev.faults().fatal();
    assert!(h.csts().cfs(), "CFS is visible as soon as fatal() returns");
    // A command submitted now is not processed.
    h.admin
        .submit(&h.dev, &Command::new(AdminOpcode::IDENTIFY.0, 77, 0));
    // Give the controller a chance to (wrongly) process it, then check nothing was posted.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(h.admin.peek().is_none());
    h.disable();
    h.enable();
    let (c, _) = h.identify(1, 0);
    assert_ok(&c);
}

#[test]
fn stopped_device_reads_all_ones() {
    let h = Host::enabled(EmuConfig::default());
    h.dev.stop();
    assert_eq!(h.regs().read_u32(CSTS), u32::MAX);
    h.regs().write_u32(CC, 0);
    assert_eq!(h.regs().read_u32(CC), u32::MAX);
}
