// Package benchproc starts, watches and stops the processes of the
// benchmark programs (e2e/bench, e2e/scale) and reads what the kernel says
// of them: CPU ticks, resident memory, the load average.
package benchproc
