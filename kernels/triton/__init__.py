"""kvfleet.kernels.triton: the Triton GPU kernels (`dispatch` imports them on first use).
Imports are absolute, so `import triton` in these modules is the Triton library, not this
package. Kept import-light: importing this package imports neither triton nor torch."""
