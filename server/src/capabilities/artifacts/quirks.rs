//! Provider quirks as data: what each S3-compatible store needs from a client, in one table
//! (in the spirit of rclone's provider quirks). A profile is chosen with `--s3-quirks`; single
//! settings (`--s3-path-style`, `--s3-region`) override it.
//!
//! Every store gets the fixes that cost nothing on AWS itself: an exact `Content-Length` on every
//! request, no tag reads on copy, no zero-byte `key/` markers listed as files, presigned URLs
//! without checksum parameters. The table holds what differs between stores.

use std::fmt;
use std::time::Duration;

/// How the SDK computes request checksums and validates response checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checksums {
    /// Only where the operation's API model requires one (DeleteObjects). Stores that do not
    /// understand `aws-chunked` bodies with trailing `x-amz-checksum-*` need this.
    WhenRequired,
    /// The SDK's default since 2025: CRC32 on every upload and validation on every download.
    WhenSupported,
}

/// What one provider needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quirks {
    pub name: &'static str,
    /// Path-style addressing (`endpoint/bucket/key`) instead of virtual-hosted buckets.
    pub path_style: bool,
    pub checksums: Checksums,
    /// Region used when none is configured (signatures name a region even where the store
    /// ignores it).
    pub default_region: &'static str,
    /// The store accepts DeleteObjects (batch delete). Where it does not (or insists on
    /// Content-MD5, which current SDKs replaced by CRC32), objects are deleted one by one.
    pub batch_delete: bool,
    /// The longest validity the store accepts for a presigned URL.
    pub max_presign_expiry: Duration,
    /// Objects above this size are copied with UploadPartCopy instead of one CopyObject.
    pub max_single_copy: u64,
    /// The store keeps listing a "directory" after its last object is deleted (SeaweedFS's filer
    /// keeps the empty directory entry, shown as a common prefix). Deletes then also delete the
    /// emptied `dir/` entries, deepest first; on other stores that is a harmless no-op.
    pub empty_dirs_linger: bool,
}

const GIB: u64 = 1 << 30;
const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);

/// The safe choice for an unknown S3-compatible store; the other profiles differ from it only
/// where their store does.
const GENERIC: Quirks = Quirks {
    name: "generic",
    path_style: true,
    checksums: Checksums::WhenRequired,
    default_region: "us-east-1",
    batch_delete: false,
    max_presign_expiry: WEEK,
    max_single_copy: GIB,
    empty_dirs_linger: true,
};

/// The known providers, `generic` first.
pub const PROFILES: &[Quirks] = &[
    GENERIC,
    Quirks {
        name: "aws",
        path_style: false,
        checksums: Checksums::WhenSupported,
        batch_delete: true,
        max_single_copy: 5 * GIB,
        empty_dirs_linger: false,
        ..GENERIC
    },
    Quirks {
        name: "seaweedfs",
        batch_delete: true,
        max_single_copy: 5 * GIB,
        ..GENERIC
    },
    Quirks {
        name: "minio",
        batch_delete: true,
        max_single_copy: 5 * GIB,
        empty_dirs_linger: false,
        ..GENERIC
    },
    // Older RGW releases require Content-MD5 on DeleteObjects: one by one.
    Quirks {
        name: "ceph",
        max_single_copy: 5 * GIB,
        empty_dirs_linger: false,
        ..GENERIC
    },
    Quirks {
        name: "r2",
        default_region: "auto",
        batch_delete: true,
        max_single_copy: 5 * GIB,
        empty_dirs_linger: false,
        ..GENERIC
    },
];

impl Quirks {
    /// The profile called `name`, or an error listing the known ones.
    pub fn named(name: &str) -> Result<&'static Quirks, String> {
        PROFILES
            .iter()
            .find(|q| q.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                let known: Vec<&str> = PROFILES.iter().map(|q| q.name).collect();
                format!(
                    "unknown S3 quirks profile {name:?}; known profiles: {}",
                    known.join(", ")
                )
            })
    }

    pub fn generic() -> &'static Quirks {
        &PROFILES[0]
    }
}

impl fmt::Display for Quirks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_are_found_by_name_and_unknown_names_list_the_known_ones() {
        assert_eq!(Quirks::named("SeaweedFS").unwrap().name, "seaweedfs");
        assert_eq!(Quirks::named("r2").unwrap().default_region, "auto");
        let err = Quirks::named("gcs").unwrap_err();
        assert!(
            err.contains("generic, aws, seaweedfs, minio, ceph, r2"),
            "{err}"
        );
        let names: std::collections::HashSet<_> = PROFILES.iter().map(|q| q.name).collect();
        assert_eq!(names.len(), PROFILES.len(), "profile names are unique");
    }

    #[test]
    fn only_aws_gets_the_sdk_default_checksums() {
        for q in PROFILES {
            assert_eq!(
                q.checksums == Checksums::WhenSupported,
                q.name == "aws",
                "{}",
                q.name
            );
        }
    }
}
