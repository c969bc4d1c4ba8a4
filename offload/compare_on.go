//go:build kvocompare

package offload

// comparisonBuild: this build reads the comparison switches
// (comparisonSwitches).
const comparisonBuild = true
