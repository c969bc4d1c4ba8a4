//go:build race || kvoinvariants

package transfer

// invariantsEnabled turns on the gating checks (Tracker, descriptor buffer
// checks). It is true under -race and with the kvoinvariants build tag, and
// false (the checks compile away) in release builds.
const invariantsEnabled = true
