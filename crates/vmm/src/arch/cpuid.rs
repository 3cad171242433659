//! The CPUID a guest sees: what KVM supports, filtered through a CPU template (a list of bit
//! masks, kept as data), then given each vCPU's identity and the VM's topology.

use std::path::Path;

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX};
use serde::{Deserialize, Deserializer};

/// The template used when none is given.
pub const DEFAULT_TEMPLATE: &str = include_str!("cpu-templates/default.json");

#[derive(Debug, thiserror::Error)]
pub enum CpuTemplateError {
    #[error("cannot read the CPU template {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the CPU template {path} is not valid: {source} (see vmm/src/arch/cpu-templates/default.json for the format)")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("the CPU template {path} names bit {bit}, but registers have bits 0 to 31")]
    BadBit { path: String, bit: u32 },
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Register {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

/// One rule: in `leaf` (and `subleaf`, or every subleaf when absent), clear then set bits of a
/// register.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuidMask {
    #[serde(deserialize_with = "hex_u32")]
    pub leaf: u32,
    #[serde(default, deserialize_with = "opt_hex_u32")]
    pub subleaf: Option<u32>,
    pub register: Register,
    #[serde(default)]
    pub clear_bits: Vec<u32>,
    #[serde(default)]
    pub set_bits: Vec<u32>,
    /// Free text for the reader.
    #[serde(default)]
    pub why: String,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuTemplate {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub cpuid: Vec<CpuidMask>,
}

impl CpuTemplate {
    /// Parse a template; `origin` names it in errors.
    pub fn parse(json: &str, origin: &str) -> Result<Self, CpuTemplateError> {
        let template: CpuTemplate =
            serde_json::from_str(json).map_err(|source| CpuTemplateError::Parse {
                path: origin.to_string(),
                source,
            })?;
        for mask in &template.cpuid {
            if let Some(&bit) = mask
                .clear_bits
                .iter()
                .chain(&mask.set_bits)
                .find(|&&b| b > 31)
            {
                return Err(CpuTemplateError::BadBit {
                    path: origin.to_string(),
                    bit,
                });
            }
        }
        Ok(template)
    }

    pub fn from_file(path: &Path) -> Result<Self, CpuTemplateError> {
        let json = std::fs::read_to_string(path).map_err(|source| CpuTemplateError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&json, &path.display().to_string())
    }

    pub fn builtin_default() -> Self {
        Self::parse(DEFAULT_TEMPLATE, "the built-in default template")
            .expect("the built-in CPU template is valid (checked by a unit test)")
    }

    /// Apply the masks to every matching entry.
    pub fn apply(&self, entries: &mut [kvm_cpuid_entry2]) {
        for mask in &self.cpuid {
            let clear = mask.clear_bits.iter().fold(0u32, |m, b| m | (1 << b));
            let set = mask.set_bits.iter().fold(0u32, |m, b| m | (1 << b));
            for entry in entries
                .iter_mut()
                .filter(|e| e.function == mask.leaf && mask.subleaf.is_none_or(|s| s == e.index))
            {
                let reg = match mask.register {
                    Register::Eax => &mut entry.eax,
                    Register::Ebx => &mut entry.ebx,
                    Register::Ecx => &mut entry.ecx,
                    Register::Edx => &mut entry.edx,
                };
                *reg = (*reg & !clear) | set;
            }
        }
    }
}

fn parse_hex(text: &str) -> Result<u32, String> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .ok_or_else(|| format!("expected a hex string like \"0x80000001\", got {text:?}"))?;
    u32::from_str_radix(digits, 16).map_err(|e| format!("{text:?}: {e}"))
}

fn hex_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    parse_hex(&String::deserialize(d)?).map_err(serde::de::Error::custom)
}

fn opt_hex_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    Option::<String>::deserialize(d)?
        .map(|s| parse_hex(&s).map_err(serde::de::Error::custom))
        .transpose()
}

/// Give vCPU `index` of `count` its APIC ID and the topology "one socket, `count` cores, one
/// thread per core", in the leaves Linux reads on Intel and AMD hosts.
pub fn set_vcpu_identity(cpuid: &mut CpuId, index: u8, count: u8) {
    let apic_id = u32::from(index);
    let count = u32::from(count);
    // Bits needed to number the cores.
    let core_bits = 32 - (count.max(1) - 1).leading_zeros();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            0x1 => {
                entry.ebx = (entry.ebx & 0x0000_ffff) | (apic_id << 24) | (count << 16);
                // HTT: the package has more than one logical processor.
                if count > 1 {
                    entry.edx |= 1 << 28;
                } else {
                    entry.edx &= !(1 << 28);
                }
            }
            0x4 => {
                // Cores per package - 1, for each cache level; caches are not shared across
                // cores except the last level, which everyone shares.
                let last_level = entry.eax & 0x1f != 0 && (entry.eax >> 5) & 0x7 >= 3;
                let sharing = if last_level { count - 1 } else { 0 };
                entry.eax = (entry.eax & 0x3ff) | ((count - 1) << 26) | (sharing << 14);
            }
            0xb | 0x1f => {
                entry.flags |= KVM_CPUID_FLAG_SIGNIFCANT_INDEX;
                entry.edx = apic_id;
                match entry.index {
                    0 => {
                        // SMT level: one thread per core.
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = 1 << 8;
                    }
                    1 => {
                        // Core level.
                        entry.eax = core_bits;
                        entry.ebx = count;
                        entry.ecx = 1 | (2 << 8);
                    }
                    _ => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = entry.index;
                    }
                }
            }
            0x8000_0001 if count > 1 => entry.ecx |= 1 << 1, // CmpLegacy
            0x8000_0008 => {
                entry.ecx = (entry.ecx & !0xf0ff) | (core_bits << 12) | (count - 1);
            }
            0x8000_001e => {
                entry.eax = apic_id;
                entry.ebx = apic_id & 0xff; // compute unit = core, one thread each
                entry.ecx = 0;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: 0xffff_ffff,
            ebx: 0xffff_ffff,
            ecx: 0xffff_ffff,
            edx: 0xffff_ffff,
            ..Default::default()
        }
    }

    #[test]
    fn builtin_template_parses_and_masks() {
        let template = CpuTemplate::builtin_default();
        let mut entries = [entry(0x1, 0), entry(0x8000_0001, 0), entry(0x7, 0)];
        entries[0].ecx = 0x7fff_ffff;
        template.apply(&mut entries);
        assert_eq!(entries[0].ecx & (1 << 3), 0, "MONITOR hidden");
        assert_eq!(entries[0].ecx & (1 << 5), 0, "VMX hidden");
        assert_ne!(entries[0].ecx & (1 << 31), 0, "hypervisor bit set");
        assert_eq!(entries[1].ecx & (1 << 2), 0, "SVM hidden");
        assert_eq!(entries[2].ebx, 0xffff_ffff, "other leaves untouched");
    }

    #[test]
    fn subleaf_limits_the_mask() {
        let template = CpuTemplate::parse(
            r#"{"name":"t","cpuid":[{"leaf":"0x7","subleaf":"0x1","register":"eax","clear_bits":[0]}]}"#,
            "test",
        )
        .unwrap();
        let mut entries = [entry(0x7, 0), entry(0x7, 1)];
        template.apply(&mut entries);
        assert_eq!(entries[0].eax, 0xffff_ffff);
        assert_eq!(entries[1].eax, 0xffff_fffe);
    }

    #[test]
    fn bad_templates_are_rejected_with_a_reason() {
        let bad_bit = CpuTemplate::parse(
            r#"{"name":"t","cpuid":[{"leaf":"0x1","register":"ecx","clear_bits":[32]}]}"#,
            "t.json",
        );
        assert!(matches!(
            bad_bit,
            Err(CpuTemplateError::BadBit { bit: 32, .. })
        ));
        let decimal_leaf = CpuTemplate::parse(
            r#"{"name":"t","cpuid":[{"leaf":"1","register":"ecx"}]}"#,
            "t.json",
        );
        let msg = decimal_leaf.unwrap_err().to_string();
        assert!(msg.contains("hex string"), "{msg}");
        let unknown_field = CpuTemplate::parse(
            r#"{"name":"t","cpuid":[{"leaf":"0x1","register":"ecx","clear":[1]}]}"#,
            "t.json",
        );
        assert!(unknown_field.is_err());
    }

    #[test]
    fn identity_and_topology() {
        let mut cpuid = CpuId::from_entries(&[
            entry(0x1, 0),
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0x8000_001e, 0),
        ])
        .unwrap();
        set_vcpu_identity(&mut cpuid, 3, 4);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_eq!(e[1].edx, 3);
        assert_eq!((e[2].eax, e[2].ebx), (2, 4));
        assert_eq!(e[3].eax, 3);
    }
}
