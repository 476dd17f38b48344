//! `csi-bench --sync-writes DIR`: what one durable journal write costs on DIR's
//! filesystem, for each way of making a small write durable. The driver's
//! journal appends one batch (a single change is about 200 bytes) and may not
//! answer before it is on disk; this times that step alone, without gRPC or the
//! driver, so that the choice of write path rests on figures of this disk.

use std::fs::{File, OpenOptions};
use std::io::IoSlice;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::io::{pwritev2, ReadWriteFlags};

use crate::scenarios::{ms, percentile};

/// Bytes of one write: one change's batch.
const RECORD: usize = 200;
/// Room made ahead of the writes that overwrite it.
const ROOM: u64 = 4 << 20;
const BLOCK: usize = 4096;
const WARMUP: usize = 20;

/// One way of making a write durable.
struct Way {
    name: &'static str,
    how: &'static str,
}

const WAYS: [Way; 6] = [
    Way {
        name: "append + fdatasync",
        how: "each write past the end, then fdatasync (the length changes every time)",
    },
    Way {
        name: "fallocated room + fdatasync",
        how: "fallocate'd (unwritten) room, each write into it, then fdatasync",
    },
    Way {
        name: "written room + fdatasync",
        how: "room written with zeros and synced, each write into it, then fdatasync",
    },
    Way {
        name: "written room + RWF_DSYNC",
        how: "the same room, each write one pwritev2(RWF_DSYNC) (the driver's journal)",
    },
    Way {
        name: "written room, O_DSYNC file",
        how: "the same room, the file opened O_DSYNC, each write one pwrite",
    },
    Way {
        name: "written room, O_DIRECT + O_DSYNC 4 KiB",
        how: "the same room, opened O_DIRECT and O_DSYNC, each write a whole aligned 4 KiB block",
    },
];

/// Times `count` durable writes each way in files under `dir`, the ways taking
/// turns write by write (so that whatever else the machine does falls on all of
/// them alike); prints a table.
pub fn run(dir: &Path, count: usize) -> Result<(), String> {
    let err = |what: &str, e: std::io::Error| format!("{what} in {}: {e}", dir.display());
    let paths: Vec<_> = (0..WAYS.len())
        .map(|i| dir.join(format!(".csi-bench-sync-writes-{i}")))
        .collect();
    let result = (|| {
        let mut files = Vec::new();
        for (i, path) in paths.iter().enumerate() {
            let _ = std::fs::remove_file(path);
            files.push(prepare(i, path).map_err(|e| err(WAYS[i].name, e))?);
        }
        let mut block_buf = vec![0x5au8; 2 * BLOCK];
        // An O_DIRECT buffer must be aligned: the first aligned block of a larger one.
        let skew = (BLOCK - block_buf.as_ptr() as usize % BLOCK) % BLOCK;
        let block = &mut block_buf[skew..skew + BLOCK];
        let mut times = vec![Vec::with_capacity(count); WAYS.len()];
        for n in 0..count + WARMUP {
            for (i, f) in files.iter().enumerate() {
                let started = Instant::now();
                write(i, f, n, block).map_err(|e| err(WAYS[i].name, e))?;
                if n >= WARMUP {
                    times[i].push(started.elapsed());
                }
            }
        }
        Ok::<_, String>(times)
    })();
    for path in &paths {
        let _ = std::fs::remove_file(path);
    }
    println!(
        "durable writes of {RECORD} bytes in {}, {count} each (after {WARMUP} not counted), ms",
        dir.display()
    );
    println!("| way | p50 | p99 | mean |\n|---|---:|---:|---:|");
    for (way, mut t) in WAYS.iter().zip(result?) {
        t.sort();
        let mean = t.iter().sum::<Duration>() / t.len() as u32;
        println!(
            "| {} | {:.3} | {:.3} | {:.3} |",
            way.name,
            ms(percentile(&t, 0.5)),
            ms(percentile(&t, 0.99)),
            ms(mean)
        );
    }
    println!();
    for way in &WAYS {
        println!("- {}: {}", way.name, way.how);
    }
    Ok(())
}

/// The file of a way, its room made and durable.
fn prepare(way: usize, path: &Path) -> std::io::Result<File> {
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(flags)
            .open(path)
    };
    let f = open(0)?;
    match way {
        0 => {}
        1 => rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, ROOM)?,
        _ => {
            let chunk = vec![0u8; 1 << 20];
            for at in (0..ROOM).step_by(chunk.len()) {
                f.write_all_at(&chunk, at)?;
            }
        }
    }
    f.sync_all()?;
    match way {
        4 => open(libc_flags::DSYNC),
        5 => open(libc_flags::DSYNC | libc_flags::DIRECT),
        _ => Ok(f),
    }
}

/// The `n`th durable write of a way.
fn write(way: usize, f: &File, n: usize, block: &[u8]) -> std::io::Result<()> {
    let record = [0x5au8; RECORD];
    let at = (n * RECORD) as u64;
    match way {
        5 => f.write_all_at(block, (n * BLOCK) as u64),
        4 => f.write_all_at(&record, at),
        3 => {
            let mut done = 0;
            while done < RECORD {
                let slice = [IoSlice::new(&record[done..])];
                done += pwritev2(f, &slice, at + done as u64, ReadWriteFlags::DSYNC)?;
            }
            Ok(())
        }
        _ => {
            f.write_all_at(&record, at)?;
            f.sync_data()
        }
    }
}

/// The open flags, as the kernel numbers them on Linux.
mod libc_flags {
    pub const DSYNC: i32 = rustix::fs::OFlags::DSYNC.bits() as i32;
    pub const DIRECT: i32 = rustix::fs::OFlags::DIRECT.bits() as i32;
}
