//go:build !kvocompare

package offload

// comparisonBuild: the release engine ignores the comparison switches
// (comparisonSwitches).
const comparisonBuild = false
