//go:build kvoinvariants

package kvcache

// invariantsOn makes every mutating call run Verify and panic on a
// violation. It is true with the kvoinvariants build tag only (not under
// -race: Verify walks every slot).
const invariantsOn = true
