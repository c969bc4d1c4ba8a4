//go:build !race && !kvoinvariants

package transfer

// invariantsEnabled: see invariants_on.go.
const invariantsEnabled = false
